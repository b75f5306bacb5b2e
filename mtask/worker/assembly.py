"""A worker's parts, made and wired together in one place (``build``).

``Worker`` (``mtask/worker/__init__.py``) is the supervisor: it holds the ``Parts`` this
builds, and runs, supervises and stops them. Every part is created here, once, before ``run``
(the clients connect on first use, inside it), each receiving its collaborators by its
constructor, in the order they depend on each other. Each wing builds its own parts
(``finding.build``, ``claiming.gate`` and ``claiming.build``, ``running.build``,
``maintenance.build``, ``reacting.build``); this module makes what they share (the clients, the
claim queue, the in-flight ledger, the worker's presence) and passes each wing what it needs of
the others. Where two parts would need each other, they meet at a ``wiring.Signal`` or
``Gauge`` made first (``wiring.Wires``).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pymongo import AsyncMongoClient, MongoClient
from pymongo.asynchronous.database import AsyncDatabase

from mtask import driver
from mtask.clock import Clock, ServerClock
from mtask.connection.clients import WORKER_CLIENT_OPTIONS, async_client, sync_client
from mtask.limits.measured import slots_of as measured_slots
from mtask.registry import Registry
from mtask.worker import claiming, finding, maintenance, reacting, running
from mtask.worker.claim_queue import ClaimQueue, GroupWeights
from mtask.worker.claiming.claimer import Claimer
from mtask.worker.claiming.gate import LimitGate
from mtask.worker.claiming.releases import SlotReleases
from mtask.worker.config import WorkerConfig
from mtask.worker.inflight import InFlight
from mtask.worker.maintenance.scheduler import Scheduler
from mtask.worker.presence import Assignment, Lifecycle, Presence
from mtask.worker.running.executor import Executor
from mtask.worker.running.output_writer import OutputWriter
from mtask.worker.running.pinger import LeasePinger, LoopTicker
from mtask.worker.running.recorder import OutcomeRecorder
from mtask.worker.service import Service
from mtask.worker.stats import WorkerStats
from mtask.worker.wiring import Wires
from mtask.worker.worker_events import Emitter

if TYPE_CHECKING:
    from mtask.worker.running.pool.pool import ProcessPool

SHARED_READ_EVERY = 5
"""With the shared stream, the heartbeat reads the paused names (and, while the worker finds its
own work, the peers: ``Finding.ranks``) every this many beats, and at once on a control's event,
which the relay passes on, or when the worker begins to find its own work."""
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
    publisher: running.Publisher
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
    wires = Wires()
    inflight = InFlight(on_free=wires.freed)
    aging = config.priority_aging
    weights = GroupWeights()
    queue = ClaimQueue(
        config.queue_size, None if aging is None else dt.timedelta(seconds=aging), weights
    )
    assignment = Assignment(tuple(names))
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
            limit=wires.limit_changed,
            limit_set=wires.limit_set,
            opened=wires.stream_opened,
            group_freed=wires.group_freed,
            schedule=wires.schedules_changed,
        ),
        capacity=wires.capacity,
        freed=wires.freed,
        claims=inflight,
        sweep_interval=config.sweep_interval,
        stagger_ms=config.stagger_ms,
    )
    chores = maintenance.build(
        adriver,
        clock,
        config,
        registry,
        leads=found.leads,
        schedules_changed=wires.schedules_changed,
    )
    gate = claiming.gate(
        adriver,
        clock,
        config,
        registry,
        names=names,
        worker_id=worker_id,
        sink=found.sink,
        ready=found.finder.ready,
        weights=weights,
        wires=wires,
    )
    run = running.build(
        adriver,
        clock,
        config,
        registry,
        names=names,
        worker_id=worker_id,
        clients=(aclient, sclient),
        inflight=inflight,
        sink=found.sink,
        releases=gate.releases,
        slots=gate.slots,
        held=gate.gate.apply,
        stats=stats,
        measured=functools.partial(measured_slots, uses=gate.gate.uses, docs=gate.gate.limited),
        emit=emit,
        wake=wake,
        wires=wires,
    )
    claims = claiming.build(
        adriver,
        clock,
        config,
        worker_id=worker_id,
        gate=gate,
        queue=queue,
        inflight=inflight,
        assignment=assignment,
        sink=found.sink,
        runs=run.executor,
        stats=stats,
        lifecycle=lifecycle,
        wake=wake,
        emit=emit,
        wires=wires,
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
        pool=run.process_pool,
        uses={n: registry[n].uses for n in names if registry[n].uses},
    )
    services: tuple[Service, ...] = (
        *found.services,
        presence,
        run.recorder,
        run.ticker,
        *claims.services,
        *chores.services,
        *(reacting.build(
            adriver,
            clock,
            registry,
            holder=worker_id,
            emit=emit,
            sweep_interval=config.sweep_interval,
            max_params_bytes=run.publisher.max_params_bytes,
        ) if config.run_triggers else ()),
    )  # fmt: skip
    return Parts(
        aclient, sclient, adb, adriver, emit, wake, inflight, queue, assignment, chores.scheduler,
        found, gate.gate, gate.releases, presence, run.recorder, run.ticker, run.pinger,
        run.publisher, run.process_pool, run.outputs, run.executor, claims.claimer, services,
    )  # fmt: skip
