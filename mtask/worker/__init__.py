"""The worker: claims tasks, runs their handlers, records outcomes.

``Worker`` is a supervisor. Its parts are built once, in one place (``assembly.build``), and
held (``Worker.parts``); it reaches MongoDB, starts the
lease pinger thread and its side services, runs the ``Claimer``'s main loop until it is told
to stop, drains, and shuts down. The parts (see docs/worker.md, "The worker package"):

- ``Claimer`` (claimer.py): the main loop and the claim path (River's producer), with
  ``ClaimCalls`` (claim_calls.py) and ``LimitedClaims`` (limited_claims.py);
- ``Executor`` (executor.py): one run from claim to outcome; ``RunOutcomes``
  (run_outcomes.py): what the run ends with;
- ``InFlight`` (inflight.py): the runs in flight and the keys being claimed, the only state
  the claimer, executor and finding parts share;
- ``Presence`` (presence.py): heartbeat, pause/resume, remote stop, peers (``Assignment``);
- finding work (``finding/``: the ``Finder`` and its sweep, fed by an ``OwnStream`` or the
  ``SharedStream``, whose relay is ``finding/shared/relay.py``), ``ClaimQueue`` (claim_queue.py),
  ``LeasePinger`` + ``LoopTicker`` (lease.py), ``OutcomeRecorder`` (recorder.py),
  ``LimitGate`` (limit_gate.py), ``Scheduler`` (scheduler.py), ``FlowSweep`` (flow_sweep.py).

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
from mtask.clock import Clock, ServerClock
from mtask.errors import MtaskError, StorageError, WorkerCrashed
from mtask.registry import Registry
from mtask.worker import assembly
from mtask.worker.config import WorkerConfig, default_worker_id
from mtask.worker.events import Event
from mtask.worker.presence import WorkerState
from mtask.worker.stats import WorkerStats

__all__ = ["Worker", "WorkerConfig", "WorkerCrashed", "WorkerState", "WorkerStats"]

log = logging.getLogger(__name__)

DRAIN_WRITE_TIMEOUT = 30.0
"""How long a stopping worker waits for its last outcomes to be written."""


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
        self.parts = assembly.build(
            self.config,
            registry,
            names=self.names,
            worker_id=self.worker_id,
            clock=self.clock,
            server_clock=self._server_clock,
            stats=self.stats,
            lifecycle=self,
        )

    # -- the public surface ---------------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        return len(self.parts.inflight)

    def stop(self, immediate: bool = False) -> None:
        """Stop claiming and drain within ``grace``; ``immediate`` cancels and releases now."""
        if self.state in ("ready", "running"):
            self.state = "stopping"
            self.parts.emit(Event.STOPPING, immediate=immediate)
        if immediate:
            self._stop_now.set()
        self.parts.wake.set()

    async def run(self) -> None:
        """Run until stopped. Raises ``WorkerCrashed`` if a part of the worker died."""
        if self.state != "ready":
            raise MtaskError(f"a worker runs once; this one is {self.state}")
        self.state = "running"
        try:
            await self._startup()
            if self.parts.process_pool is not None and self.config.pool == "process":
                await self.parts.process_pool.start(
                    self.concurrency
                )  # warm, before the first claim
            self.parts.pinger.start(asyncio.get_running_loop())
            self._supervise()
            self.parts.emit(Event.STARTED, names=self.names, concurrency=self.concurrency)
            await self.parts.claimer.run()
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
                    await self._server_clock.calibrate_async(self.parts.adb)
                await self.parts.driver.run(store.ensure_indexes())
                # the pinger's client connects now, not on the first ping of a claimed run
                await asyncio.to_thread(self.parts.sclient.admin.command, "ping")
                await self.parts.presence.beat()
                self._registered = True
                await self.parts.gate.refresh()
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
        for service in self.parts.services:
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

    # -- stopping -------------------------------------------------------------------------------

    async def _drain(self) -> None:
        """Step one of stopping: let the runs in flight finish within ``grace`` (or until an
        immediate stop); step two: cancel and release the rest; then let their outcomes land."""
        await self.parts.executor.drain(self.grace, self._stop_now)
        if self._crash is None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.parts.recorder.all_written.wait(), DRAIN_WRITE_TIMEOUT)

    async def _shutdown(self) -> None:
        for task in self._side:
            task.cancel()
        await asyncio.gather(*self._side, return_exceptions=True)
        with contextlib.suppress(TimeoutError):  # slots kept for a handover no run will take
            await asyncio.wait_for(self.parts.gate.flush(keep=False), timeout=5)
        await asyncio.to_thread(self.parts.pinger.stop)
        if self.parts.process_pool is not None:
            await self.parts.process_pool.close()
        if self._registered:
            with contextlib.suppress(StorageError, TimeoutError):
                await asyncio.wait_for(
                    self.parts.driver.run(control.deregister(self.worker_id)), timeout=5
                )
        await self.parts.aclient.close()
        self.parts.sclient.close()
        self.state = "stopped"
        self.parts.emit(Event.STOPPED, stats=self.stats)
