"""A worker's parts, made and wired together in one place (``build``).

``Worker`` (``mtask/worker/__init__.py``) is the supervisor: it holds the ``Parts`` this
builds, and runs, supervises and stops them. Every part is created here, once, before ``run``
(the clients connect on first use, inside it), each receiving its collaborators by its
constructor, in the order they depend on each other: the claim queue, the in-flight ledger,
the finding parts (whose sink is the ``QueueSink`` of the claimer, gate and recorder), the
lease pinger, the outcome writer, the run's parts (its contexts, the handler's call, its
outcomes), the executor and the side services. Where two parts would
need each other, they meet at a ``wiring.Signal`` or ``Gauge`` made first.
"""

from __future__ import annotations

import asyncio
import datetime as dt
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pymongo import AsyncMongoClient, MongoClient
from pymongo.asynchronous.database import AsyncDatabase

from mtask import driver
from mtask.client import AsyncTaskClient
from mtask.clock import Clock, ServerClock
from mtask.connection.clients import WORKER_CLIENT_OPTIONS, async_client, sync_client
from mtask.limits.holds import Holds
from mtask.registry import Registry
from mtask.worker import finding, reacting
from mtask.worker.claim_queue import ClaimQueue, GroupWeights
from mtask.worker.claiming import ahead as claim_ahead
from mtask.worker.claiming.claim_calls import ClaimCalls
from mtask.worker.claiming.claimer import Claimer
from mtask.worker.claiming.gate import REFRESH_SECONDS, LimitGate
from mtask.worker.claiming.limited_claims import LimitedClaims
from mtask.worker.claiming.recount import Recount
from mtask.worker.claiming.releases import SlotReleases
from mtask.worker.config import WorkerConfig
from mtask.worker.flow_sweep import FlowSweep
from mtask.worker.inflight import InFlight
from mtask.worker.presence import Assignment, Lifecycle, Presence
from mtask.worker.running.batches import Batches
from mtask.worker.running.call import HandlerCalls
from mtask.worker.running.context import RunContexts
from mtask.worker.running.executor import Executor
from mtask.worker.running.lease import LeasePinger, LoopTicker
from mtask.worker.running.outcomes import RunOutcomes
from mtask.worker.running.output_writer import OutputWriter
from mtask.worker.running.recorder import OutcomeRecorder
from mtask.worker.running.sealing import from_env as sealing_from_env
from mtask.worker.running.step_stores import RunStepStores
from mtask.worker.running.task_deadlines import TaskDeadlines
from mtask.worker.running.transactional import Transactions
from mtask.worker.scheduler import POLL_SECONDS as SCHEDULES_POLL
from mtask.worker.scheduler import Scheduler
from mtask.worker.service import Service
from mtask.worker.stats import WorkerStats
from mtask.worker.wiring import Gauge, Signal
from mtask.worker.worker_events import Emitter

if TYPE_CHECKING:
    from mtask.worker.running.pool.pool import ProcessPool

SHARED_READ_EVERY = 5
"""With the shared stream, the heartbeat reads the paused names (and, while the worker finds its
own work, the peers: ``Finding.ranks``) every this many beats, and at once on a control's event,
which the relay passes on, or when the worker begins to find its own work."""
SHARED_LIMITS_REFRESH = 30.0
"""With the shared stream, the limit gate's bounding read (the relay passes the limits' change
events on as they come, and a change applies on its event), as the sweep bounds a lost task
event."""
SHARED_SCHEDULES_POLL = 60.0
"""With the shared stream, the scheduler's bounding read (the relay passes the schedules' change
events on as they come; it wakes at each schedule's next tick in any case)."""
SHARED_QUIET_EVERY = 3
"""With the shared stream, an idle worker whose heartbeat would say nothing new writes it every
this many intervals (6 s by default: live in ``client.workers``' 10 s window)."""


@dataclass(frozen=True)
class Parts:
    """Every part of one worker, made together by ``build``."""

    aclient: AsyncMongoClient[dict[str, Any]]
    sclient: MongoClient[dict[str, Any]]
    adb: AsyncDatabase[dict[str, Any]]
    driver: driver.AsyncDriver
    emit: Emitter
    wake: asyncio.Event
    inflight: InFlight
    queue: ClaimQueue
    assignment: Assignment
    scheduler: Scheduler
    finding: finding.Finding
    gate: LimitGate
    releases: SlotReleases
    presence: Presence
    recorder: OutcomeRecorder
    ticker: LoopTicker
    pinger: LeasePinger
    publisher: AsyncTaskClient
    process_pool: ProcessPool | None
    outputs: OutputWriter
    executor: Executor
    claimer: Claimer
    services: tuple[Service, ...]


def build(
    config: WorkerConfig,
    registry: Registry,
    *,
    names: list[str],
    worker_id: str,
    clock: Clock,
    server_clock: ServerClock | None,
    stats: WorkerStats,
    lifecycle: Lifecycle,
) -> Parts:
    """Every part, created together (clients connect on first use, inside ``run``)."""
    shared = config.stream == "shared"
    aclient = async_client(config.uri, defaults=WORKER_CLIENT_OPTIONS, connect=False)
    sclient = sync_client(config.uri, defaults=WORKER_CLIENT_OPTIONS, connect=False)
    adb = aclient[config.database]
    adriver = driver.AsyncDriver(driver.collections(adb, config.collection))
    emit = Emitter(config.on_event)
    wake = asyncio.Event()
    freed: Signal[[]] = Signal()
    limit_changed: Signal[[str]] = Signal()
    limit_set: Signal[[str]] = Signal()
    limit_applied: Signal[[str]] = Signal()
    stream_opened: Signal[[]] = Signal()
    group_freed: Signal[[str, str]] = Signal()
    lost: Signal[[str, dict[str, Any] | None]] = Signal()
    slot_lost: Signal[[str, str]] = Signal()
    run_started: Signal[[str]] = Signal()
    run_ended: Signal[[float]] = Signal()
    capacity = Gauge()
    inflight = InFlight(on_free=freed)
    aging = config.priority_aging
    weights = GroupWeights()
    queue = ClaimQueue(
        config.queue_size, None if aging is None else dt.timedelta(seconds=aging), weights
    )
    assignment = Assignment(tuple(names))
    scheduler = Scheduler(
        adriver,
        clock,
        list(registry.schedules.values()),
        poll=SHARED_SCHEDULES_POLL if shared else SCHEDULES_POLL,
    )
    controls_changed = asyncio.Event()
    found = finding.build(
        adriver,
        clock,
        stream=config.stream,
        worker_id=worker_id,
        queue=queue,
        assignment=assignment,
        in_flight=inflight.busy,
        wake=wake.set,
        others=finding.Others(
            control=controls_changed.set,
            limit=limit_changed,
            limit_set=limit_set,
            opened=stream_opened,
            group_freed=group_freed,
            schedule=scheduler.wake.set,
        ),
        capacity=capacity,
        freed=freed,
        claims=inflight,
        sweep_interval=config.sweep_interval,
        stagger_ms=config.stagger_ms,
    )
    refresh = config.limits_refresh or (SHARED_LIMITS_REFRESH if shared else REFRESH_SECONDS)
    gate = LimitGate(
        adriver,
        worker_id,
        clock,
        found.sink,
        interval=refresh,
        changes=limit_changed,
        freed=group_freed,
        limit_set=limit_set,
        applied=limit_applied,
        reopened=stream_opened,
        ready=found.finder.ready,
        weights=weights,
        uses={n: registry[n].uses for n in names if registry[n].uses},
        units={n: registry[n].units for n in names if registry[n].units != 1},
    )
    releases = SlotReleases(adriver, clock, gate)
    process_pool: ProcessPool | None = None  # handler isolation
    if config.pool == "process" or any(registry[n].isolation == "process" for n in names):
        from mtask.worker.running.pool.pipe import Bounds  # multiprocessing: this worker's only
        from mtask.worker.running.pool.pool import ProcessPool

        modules = {registry[n].fn.__module__ for n in names}
        process_pool = ProcessPool(
            max_tasks_per_child=config.max_tasks_per_child,
            max_memory_per_child=config.max_memory_per_child,
            memory_limit=config.memory_limit_per_child,
            preload=tuple(sorted(modules - {"__main__"})),
            bounds=Bounds.of(config.max_result_bytes),
        )
    presence = Presence(
        adriver,
        clock,
        worker_id=worker_id,
        concurrency=config.concurrency,
        interval=config.heartbeat_interval,
        inflight=inflight,
        lifecycle=lifecycle,
        emit=emit,
        assignment=assignment,
        rescanner=found.finder,
        controls_changed=controls_changed,
        server_clock=server_clock,
        database=adb,
        read_every=SHARED_READ_EVERY if shared else 1,
        stream_state=found.state,
        quiet_every=SHARED_QUIET_EVERY if shared else 1,
        ranks=found.ranks,
        pool=process_pool,
        uses={n: registry[n].uses for n in names if registry[n].uses},
    )
    recorder = OutcomeRecorder(
        adriver, clock, releases=releases, sink=found.sink, inflight=inflight, emit=emit, wake=wake
    )
    ticker = LoopTicker()
    sdb = sclient[config.database]
    pinger = LeasePinger(
        driver.SyncDriver(driver.collections(sdb, config.collection)),
        worker_id,
        clock,
        on_lost=lost,
        on_slot_lost=slot_lost,
        loop_heartbeat=lambda: ticker.last,
    )
    publisher = AsyncTaskClient(
        database=config.database, collection=config.collection, clock=clock, mongo_client=aclient
    )
    outputs = OutputWriter(aclient, adriver, clock)
    transactions = Transactions(aclient, adriver, clock)
    handled = frozenset(names)  # another name's limit anywhere in the cluster stops nothing here
    ahead, slots = claim_ahead.build(
        config.concurrency,
        config.prefetch,
        limited=lambda: not handled.isdisjoint(gate.restricting),
    )
    outcomes = RunOutcomes(stats, emit, config.max_result_bytes, publisher.max_params_bytes)
    contexts = RunContexts(
        registry=registry,
        worker_id=worker_id,
        publisher=publisher.publish,
        inflight=inflight,
        outputs=outputs,
        journals=RunStepStores(
            adriver, clock, transactions, watched=registry.watched, options_for=registry.options_for
        ),
        leases=pinger,
    )
    handler_calls = HandlerCalls(
        outcomes,
        transactions=transactions,
        leases=pinger,
        outputs=outputs,
        pool=process_pool,
        isolation=config.pool,
        slots=slots,
        sealing=sealing_from_env(sclient, config.database),
        batches=Batches(emit, slots=config.concurrency),
        holds=Holds(adriver, clock, gate.apply),
    )
    executor = Executor(
        registry=registry,
        inflight=inflight,
        pinger=pinger,
        recorder=recorder,
        contexts=contexts,
        calls=handler_calls,
        outcomes=outcomes,
        stats=stats,
        wake=wake,
        emit=emit,
        lost=lost,
        slot_lost=slot_lost,
        task_deadlines=TaskDeadlines(clock, Signal()),
        run_started=run_started,
        run_ended=run_ended,
    )
    calls = ClaimCalls(adriver, clock, worker_id=worker_id, ignore=found.sink.ignore)
    limited_claims = LimitedClaims(
        adriver,
        calls,
        clock,
        gate=gate,
        releases=releases,
        sink=found.sink,
        inflight=inflight,
        runs=executor,
        stats=stats,
        wake=wake,
    )
    claimer = Claimer(
        clock,
        calls,
        limited_claims,
        concurrency=config.concurrency,
        ahead=ahead,
        queue=queue,
        inflight=inflight,
        assignment=assignment,
        sink=found.sink,
        gate=gate,
        runs=executor,
        stats=stats,
        lifecycle=lifecycle,
        wake=wake,
    )
    capacity.measure_with(claimer.capacity)
    run_started.connect(queue.discard)  # a started run's key leaves the claim queue
    run_ended.connect(ahead.ran)  # how long runs take: whether to claim ahead
    recount = Recount(
        adriver,
        clock,
        worker_id,
        gate=gate,
        inflight=inflight,
        runs=executor,
        emit=emit,
        changed=limit_applied,
    )
    services: tuple[Service, ...] = (
        *found.services,
        presence,
        recorder,
        ticker,
        gate,
        recount,
        FlowSweep(adriver, clock, config.flow_sweep_interval, found.leads),
        *([scheduler] if config.run_schedules else []),
        *(reacting.build(
            adriver,
            clock,
            registry,
            holder=worker_id,
            emit=emit,
            sweep_interval=config.sweep_interval,
            max_params_bytes=publisher.max_params_bytes,
        ) if config.run_triggers else ()),
    )  # fmt: skip
    return Parts(
        aclient, sclient, adb, adriver, emit, wake, inflight, queue, assignment, scheduler,
        found, gate, releases, presence, recorder, ticker, pinger, publisher, process_pool, outputs,
        executor, claimer, services,
    )  # fmt: skip
