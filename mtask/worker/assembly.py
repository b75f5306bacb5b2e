"""A worker's parts, made and wired together in one place (``Assembly._build``).

``Worker`` (``mtask/worker/__init__.py``) is the supervisor: it runs, supervises and stops
what this builds. Every part is created here, once, before ``run`` (the clients connect on
first use, inside it), so no part is ever ``None`` and each gets what it needs by its
constructor: the claim queue, the in-flight ledger, the finding parts (whose sink is the
``QueueSink`` of the claimer, gate and recorder), the lease pinger, the outcome writer, the
executor and the side services, in the order they depend on each other.
"""

from __future__ import annotations

import asyncio
from typing import Any

from mtask import driver
from mtask.client import AsyncTaskClient
from mtask.clock import Clock, ServerClock
from mtask.connection import async_client, sync_client
from mtask.registry import Registry
from mtask.worker import finding
from mtask.worker.claim_queue import ClaimQueue
from mtask.worker.claimer import Claimer
from mtask.worker.config import WorkerConfig
from mtask.worker.events import Emitter
from mtask.worker.executor import Executor, RunOutcomes, WorkerStats
from mtask.worker.flow_sweep import FlowSweep
from mtask.worker.inflight import InFlight
from mtask.worker.lease import LeasePinger, LoopTicker
from mtask.worker.limit_gate import REFRESH_SECONDS, LimitGate
from mtask.worker.pool import ProcessPool
from mtask.worker.presence import Assignment, Presence, WorkerState
from mtask.worker.recorder import OutcomeRecorder
from mtask.worker.scheduler import POLL_SECONDS as SCHEDULES_POLL
from mtask.worker.scheduler import Scheduler
from mtask.worker.service import Service
from mtask.worker.transactional import Transactions

SHARED_READ_EVERY = 5
"""With the shared stream, the heartbeat reads the paused names and the peers every this many
beats (and at once on a control's event, which the relay passes on)."""
SHARED_SCHEDULES_POLL = 60.0
"""With the shared stream, the scheduler's bounding read (the relay passes the schedules' change
events on as they come; it wakes at each schedule's next tick in any case)."""
SHARED_QUIET_EVERY = 3
"""With the shared stream, an idle worker whose heartbeat would say nothing new writes it every
this many intervals (6 s by default: live in ``client.workers``' 10 s window)."""
SHARED_LIMITS_REFRESH = 30.0
"""With the shared stream, the limit gate's bounding read (the relay passes the limits' change
events on as they come), as the sweep bounds a lost task event."""


class Assembly:
    """The parts of a ``Worker`` and how they are wired (the worker supplies what they call
    back: its state, ``stop``, and what to do on a changed limit or a lost lease)."""

    config: WorkerConfig
    registry: Registry
    names: list[str]
    worker_id: str
    concurrency: int
    clock: Clock
    stats: WorkerStats
    _server_clock: ServerClock | None
    state: WorkerState

    def stop(self, immediate: bool = False) -> None:
        raise NotImplementedError

    def _limit_changed(self, name: str) -> None:
        raise NotImplementedError

    def _lost(self, run_id: str, doc: dict[str, Any] | None) -> None:
        raise NotImplementedError

    def _capacity(self) -> int:
        """How many more tasks this worker can take now (``--stream shared``: its credit)."""
        if self.state != "running" or self.recorder.unwritten > self.concurrency:
            return 0
        return self.claimer.concurrency - self.inflight.load - self.queue.due(self.clock.now())

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
        shared = config.stream == "shared"
        self.scheduler = Scheduler(
            self.driver,
            self.clock,
            list(self.registry.schedules.values()),
            poll=SHARED_SCHEDULES_POLL if shared else SCHEDULES_POLL,
        )
        controls_changed = asyncio.Event()
        # finding work (issue 25): which parts are made is the choice of --stream
        self.finding = finding.build(
            self.driver,
            self.clock,
            stream=config.stream,
            worker_id=self.worker_id,
            queue=self.queue,
            assignment=self.assignment,
            in_flight=self.inflight.busy,
            wake=self.wake.set,
            others=finding.Others(
                control=controls_changed.set,
                limit=self._limit_changed,
                schedule=self.scheduler.wake.set,
            ),
            capacity=self._capacity,
            sweep_interval=config.sweep_interval,
            stagger_ms=config.stagger_ms,
        )
        self.inflight.on_free = self.finding.freed
        self.gate = LimitGate(
            self.driver,
            self.worker_id,
            self.clock,
            self.finding.sink,
            interval=SHARED_LIMITS_REFRESH if shared else REFRESH_SECONDS,
        )
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
            rescanner=self.finding.finder,
            controls_changed=controls_changed,
            server_clock=self._server_clock,
            database=self._adb,
            read_every=SHARED_READ_EVERY if shared else 1,
            quiet_every=SHARED_QUIET_EVERY if shared else 1,
            stream_state=self.finding.state,
        )
        self.recorder = OutcomeRecorder(
            self.driver,
            self.clock,
            gate=self.gate,
            sink=self.finding.sink,
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
                memory_limit=config.memory_limit_per_child,
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
            sink=self.finding.sink,
            gate=self.gate,
            recorder=self.recorder,
            executor=self.executor,
            stats=self.stats,
            lifecycle=self,
            wake=self.wake,
        )
        self.services: list[Service] = [
            *self.finding.services,
            self.presence,
            self.recorder,
            self.ticker,
            self.gate,
            FlowSweep(
                self.driver,
                self.clock,
                config.flow_sweep_interval,
                self.finding.leads,
            ),
            *([self.scheduler] if config.run_schedules else []),
        ]
