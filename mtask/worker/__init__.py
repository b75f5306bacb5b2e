"""The worker: claims tasks, runs their handlers, records outcomes.

``Worker`` is a supervisor. It builds its parts once (``_build``), reaches MongoDB, starts the
lease pinger thread and its side services, runs the ``Claimer``'s main loop until it is told
to stop, drains, and shuts down. The parts (see docs/design.md, "The worker package"):

- ``Claimer`` (claimer.py): the main loop and the claim path (River's producer);
- ``Executor`` (executor.py): one run from claim to outcome, and ``RunOutcomes``;
- ``InFlight`` (inflight.py): the runs in flight and the keys being claimed, the only state
  the claimer, executor and watcher share;
- ``Presence`` (presence.py): heartbeat, pause/resume, remote stop, peers (``Assignment``);
- ``Watcher`` + ``Sweep`` (watcher.py), ``ClaimQueue`` (claim_queue.py), ``LeasePinger`` +
  ``LoopTicker`` (lease.py), ``OutcomeRecorder`` (recorder.py), ``LimitGate`` (limit_gate.py),
  ``Scheduler`` (scheduler.py), ``FlowSweep`` (flow_sweep.py).

Lifecycle ``ready → running → stopping → stopped``. Side services are supervised: if one dies,
the worker stops at once and ``run()`` raises ``WorkerCrashed``, instead of living on
half-alive. Stopping has two steps: ``stop()`` stops claiming and lets runs in flight finish
within ``grace`` seconds; then (or at once with ``stop(immediate=True)``) the rest are
cancelled and their runs marked RELEASED, so another worker takes them at once without
spending a retry.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from pymongo.errors import PyMongoError

from mtask import control, driver, store
from mtask.client import AsyncTaskClient
from mtask.clock import Clock, ServerClock
from mtask.connection import async_client, sync_client
from mtask.errors import MtaskError, StorageError, WorkerCrashed
from mtask.pool import ProcessPool
from mtask.registry import Registry
from mtask.transactional import Transactions
from mtask.worker.claim_queue import ClaimQueue
from mtask.worker.claimer import Claimer
from mtask.worker.config import WorkerConfig, default_worker_id
from mtask.worker.events import Emitter, Event
from mtask.worker.executor import Executor, RunOutcomes, WorkerStats
from mtask.worker.flow_sweep import FlowSweep
from mtask.worker.inflight import InFlight
from mtask.worker.lease import LeasePinger, LoopTicker
from mtask.worker.limit_gate import LimitGate
from mtask.worker.presence import Assignment, Presence, WorkerState
from mtask.worker.recorder import OutcomeRecorder
from mtask.worker.scheduler import Scheduler
from mtask.worker.service import Service
from mtask.worker.stream import OwnStream
from mtask.worker.stream_relay import SharedStream
from mtask.worker.watcher import Sweep, Watcher

__all__ = ["Worker", "WorkerConfig", "WorkerCrashed", "WorkerState", "WorkerStats"]

log = logging.getLogger(__name__)

DRAIN_WRITE_TIMEOUT = 30.0
"""How long a stopping worker waits for its last outcomes to be written."""


class _ChangeStream:
    name = "stream"

    def __init__(self, watcher: Watcher) -> None:
        self.run = watcher.run_stream


class Worker:
    """Run the handlers of ``registry``; the keyword arguments are ``WorkerConfig``'s."""

    def __init__(
        self, registry: Registry, *, config: WorkerConfig | None = None, **options: Any
    ) -> None:
        self.config = config or WorkerConfig(**options)
        self.names = self.config.chosen_names(registry)
        self.registry = registry
        self.worker_id = self.config.worker_id or default_worker_id()
        self.concurrency = self.config.concurrency
        self.grace = self.config.grace
        self.state: WorkerState = "ready"
        """Written by ``run`` and ``stop`` on the event loop's thread."""
        self.stats = WorkerStats()
        self.clock: Clock = self.config.clock or ServerClock()
        # A ServerClock (ours or an injected one) is calibrated here; other clocks are trusted.
        self._server_clock = self.clock if isinstance(self.clock, ServerClock) else None
        self._stop_now = asyncio.Event()
        self._side: list[asyncio.Task[None]] = []
        self._crash: BaseException | None = None
        self._registered = False
        """The worker's document was written (startup reached MongoDB): deregister on exit."""
        self._build()

    def _build(self) -> None:
        """Every part, created together (clients connect on first use, inside ``run``)."""
        config = self.config
        self._aclient = async_client(config.uri, connect=False)
        self._sclient = sync_client(config.uri, connect=False)
        self._adb = self._aclient[config.database]
        self.driver = driver.AsyncDriver(driver.collections(self._adb, config.collection))
        self.emit = Emitter(config.on_event)
        self.wake = asyncio.Event()
        self.inflight = InFlight()
        self.queue = ClaimQueue(config.queue_size)
        self.assignment = Assignment(tuple(self.names))
        self.scheduler = Scheduler(self.driver, self.clock, list(self.registry.schedules.values()))
        controls_changed = asyncio.Event()
        self.stream = SharedStream() if config.stream == "shared" else OwnStream()
        self.watcher = Watcher(
            self.driver,
            worker_id=self.worker_id,
            queue=self.queue,
            clock=self.clock,
            wake=self.wake.set,
            in_flight=self.inflight.busy,
            on_control=controls_changed.set,
            on_limit=self._limit_changed,
            on_schedule=self.scheduler.wake.set,
            sweep_interval=config.sweep_interval,
            stagger_ms=config.stagger_ms,
            assignment=self.assignment,
            source=self.stream,
        )
        self.gate = LimitGate(self.driver, self.worker_id, self.clock, self.watcher)
        self.presence = Presence(
            self.driver,
            self.clock,
            worker_id=self.worker_id,
            concurrency=self.concurrency,
            interval=config.heartbeat_interval,
            inflight=self.inflight,
            lifecycle=self,
            emit=self.emit,
            assignment=self.assignment,
            rescanner=self.watcher,
            controls_changed=controls_changed,
            server_clock=self._server_clock,
            database=self._adb,
        )
        self.recorder = OutcomeRecorder(
            self.driver,
            self.clock,
            gate=self.gate,
            sink=self.watcher,
            inflight=self.inflight,
            emit=self.emit,
            wake=self.wake,
        )
        self.ticker = LoopTicker()
        sdb = self._sclient[config.database]
        self.pinger = LeasePinger(
            driver.SyncDriver(driver.collections(sdb, config.collection)),
            self.worker_id,
            self.clock,
            on_lost=self._lost,
            loop_heartbeat=lambda: self.ticker.last,
        )
        self._publisher = AsyncTaskClient(
            database=config.database,
            collection=config.collection,
            clock=self.clock,
            mongo_client=self._aclient,
        )
        outcomes = RunOutcomes(
            self.stats, self.emit, config.max_result_bytes, self._publisher.max_params_bytes
        )
        outcomes.transactions = Transactions(self._aclient, self.driver, self.clock)
        self.process_pool: ProcessPool | None = None  # handler isolation (issue 18)
        if config.pool == "process" or any(
            self.registry[n].isolation == "process" for n in self.names
        ):
            modules = {self.registry[n].fn.__module__ for n in self.names}
            self.process_pool = ProcessPool(
                max_tasks_per_child=config.max_tasks_per_child,
                max_memory_per_child=config.max_memory_per_child,
                preload=tuple(sorted(modules - {"__main__"})),
            )
        outcomes.pool, outcomes.isolation = self.process_pool, config.pool
        outcomes.slots = asyncio.Semaphore(self.concurrency)  # prefetched runs wait here
        self.presence.pool = self.process_pool
        self.executor = Executor(
            registry=self.registry,
            worker_id=self.worker_id,
            publisher=self._publisher.publish,
            inflight=self.inflight,
            queue=self.queue,
            pinger=self.pinger,
            recorder=self.recorder,
            outcomes=outcomes,
            wake=self.wake,
            emit=self.emit,
        )
        self.claimer = Claimer(
            self.driver,
            self.clock,
            worker_id=self.worker_id,
            concurrency=self.concurrency + config.prefetch,
            queue=self.queue,
            inflight=self.inflight,
            assignment=self.assignment,
            sink=self.watcher,
            gate=self.gate,
            recorder=self.recorder,
            executor=self.executor,
            stats=self.stats,
            lifecycle=self,
            wake=self.wake,
        )
        self.services: list[Service] = [
            _ChangeStream(self.watcher),
            Sweep(self.watcher),
            self.presence,
            self.recorder,
            self.ticker,
            self.gate,
            FlowSweep(self.driver, self.clock, config.flow_sweep_interval),
            *([self.scheduler] if config.run_schedules else []),
        ]

    # -- the public surface ---------------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        return len(self.inflight)

    @property
    def _peers(self) -> dict[str, list[str]]:
        """The live workers per name (read by mtask.bench's stampede measure)."""
        return {name: list(ids) for name, ids in self.assignment.peers.items()}

    def stop(self, immediate: bool = False) -> None:
        """Stop claiming and drain within ``grace``; ``immediate`` cancels and releases now."""
        if self.state in ("ready", "running"):
            self.state = "stopping"
            self.emit(Event.STOPPING, immediate=immediate)
        if immediate:
            self._stop_now.set()
        self.wake.set()

    async def run(self) -> None:
        """Run until stopped. Raises ``WorkerCrashed`` if a part of the worker died."""
        if self.state != "ready":
            raise MtaskError(f"a worker runs once; this one is {self.state}")
        self.state = "running"
        try:
            await self._startup()
            if self.process_pool is not None and self.config.pool == "process":
                await self.process_pool.start(self.concurrency)  # warm, before the first claim
            self.pinger.start(asyncio.get_running_loop())
            self._supervise()
            self.emit(Event.STARTED, names=self.names, concurrency=self.concurrency)
            await self.claimer.run()
            await self._drain()
        finally:
            await self._shutdown()
        if self._crash is not None:
            raise WorkerCrashed(
                f"worker stopped because a part of it died: {self._crash!r}"
            ) from self._crash

    # -- startup and supervision ----------------------------------------------------------------

    async def _startup(self) -> None:
        """Reach MongoDB, retrying transient errors for up to ``startup_timeout`` seconds."""
        backoff = 0.5
        timeout = self.config.startup_timeout
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            try:
                if self._server_clock is not None:
                    await self._server_clock.calibrate_async(self._adb)
                await self.driver.run(store.ensure_indexes())
                # the pinger's client connects now, not on the first ping of a claimed run
                await asyncio.to_thread(self._sclient.admin.command, "ping")
                await self.presence.beat()
                self._registered = True
                await self.gate.refresh()
                return
            except (StorageError, PyMongoError) as exc:
                error = exc if isinstance(exc, StorageError) else driver.storage_error(exc)
                if self.state != "running" or not error.transient:
                    raise error from exc
                if asyncio.get_running_loop().time() + backoff > deadline:
                    raise StorageError(
                        f"gave up after {timeout:g}s: {error}", transient=True
                    ) from exc
                log.warning(
                    "cannot reach MongoDB yet, retrying in %.1fs: %s",
                    backoff,
                    error,
                    extra={"worker_id": self.worker_id},
                )
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 10)

    def _supervise(self) -> None:
        for service in self.services:
            task = asyncio.create_task(service.run(), name=f"mtask-{service.name}")
            task.add_done_callback(self._side_done)
            self._side.append(task)

    def _side_done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() or self._crash is not None:
            return
        exc = task.exception()
        self._crash = exc or RuntimeError(f"{task.get_name()} ended unexpectedly")
        log.error(
            "%s died: %r; stopping the worker",
            task.get_name(),
            self._crash,
            extra={"service": task.get_name()},
        )
        self.stop(immediate=True)

    def _limit_changed(self, name: str) -> None:
        self.gate.on_change(name)

    def _lost(self, run_id: str, doc: dict[str, Any] | None) -> None:
        self.executor.lost(run_id, doc)

    # -- stopping -------------------------------------------------------------------------------

    async def _drain(self) -> None:
        """Step one of stopping: let the runs in flight finish within ``grace`` (or until an
        immediate stop); step two: cancel and release the rest; then let their outcomes land."""
        await self.executor.drain(self.grace, self._stop_now)
        if self._crash is None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.recorder.all_written.wait(), DRAIN_WRITE_TIMEOUT)

    async def _shutdown(self) -> None:
        for task in self._side:
            task.cancel()
        await asyncio.gather(*self._side, return_exceptions=True)
        await asyncio.to_thread(self.pinger.stop)
        if self.process_pool is not None:
            await self.process_pool.close()
        if self._registered:
            with contextlib.suppress(StorageError, TimeoutError):
                await asyncio.wait_for(
                    self.driver.run(control.deregister(self.worker_id)), timeout=5
                )
        await self._aclient.close()
        self._sclient.close()
        self.state = "stopped"
        self.emit(Event.STOPPED, stats=self.stats)
