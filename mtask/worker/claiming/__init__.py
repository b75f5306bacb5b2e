"""Claiming (River's producer): which due keys to claim, the cluster-wide limits and groups
decided before a claim, and the claim calls themselves; each claimed document is handed to
the run side through ``running.protocols.RunStarter``.

Its parts are made in two steps, around the run side's: ``gate`` makes the worker's side of
the cluster-wide limits (``LimitGate``, ``SlotReleases``) and how far it claims ahead, which
the run side is built with (the slots its runs give back, the handler slots a run claimed
ahead waits for); ``build`` makes the claim path (``Claimer``, ``LimitedClaims``, ``Recount``)
once the run side is there, and connects to the executor's ``run_started`` and ``run_ended``.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from mtask.clock import Clock
from mtask.driver import AsyncDriver
from mtask.registry import Registry
from mtask.worker.claim_queue import ClaimQueue, GroupWeights
from mtask.worker.claiming import ahead as claim_ahead
from mtask.worker.claiming.ahead import ClaimAhead
from mtask.worker.claiming.claim_calls import ClaimCalls
from mtask.worker.claiming.claimer import Claimer
from mtask.worker.claiming.gate import REFRESH_SECONDS, LimitGate
from mtask.worker.claiming.limited_claims import LimitedClaims
from mtask.worker.claiming.recount import Recount
from mtask.worker.claiming.releases import SlotReleases
from mtask.worker.config import WorkerConfig
from mtask.worker.finding.protocols import QueueSink
from mtask.worker.inflight import InFlight
from mtask.worker.presence import Assignment, Lifecycle
from mtask.worker.running.handler_slots import RunSlots
from mtask.worker.running.protocols import RunStarter
from mtask.worker.service import Service
from mtask.worker.stats import WorkerStats
from mtask.worker.wiring import Wires
from mtask.worker.worker_events import Emitter

SHARED_LIMITS_REFRESH = 30.0
"""With the shared stream, the limit gate's bounding read (the relay passes the limits' change
events on as they come, and a change applies on its event), as the sweep bounds a lost task
event."""


@dataclass(frozen=True)
class Gate:
    """The claim side's parts the run side is built with."""

    gate: LimitGate
    releases: SlotReleases
    """Where the recorder gives the slots of ended runs back (its ``SlotReturns``)."""
    ahead: ClaimAhead
    slots: RunSlots | None
    """The handler slots a run claimed ahead waits for (``None``: no run waits)."""


@dataclass(frozen=True)
class Claiming:
    """The claim path, made once the run side is there."""

    claimer: Claimer
    services: tuple[Service, ...]
    """What runs for it: the gate's reads, the recount of a changed limit."""


def gate(
    driver: AsyncDriver,
    clock: Clock,
    config: WorkerConfig,
    registry: Registry,
    *,
    names: list[str],
    worker_id: str,
    sink: QueueSink,
    ready: asyncio.Event,
    weights: GroupWeights,
    wires: Wires,
) -> Gate:
    """The worker's side of the cluster-wide limits, and how far it claims ahead."""
    shared = config.stream == "shared"
    limit_gate = LimitGate(
        driver,
        worker_id,
        clock,
        sink,
        interval=config.limits_refresh or (SHARED_LIMITS_REFRESH if shared else REFRESH_SECONDS),
        changes=wires.limit_changed,
        freed=wires.group_freed,
        limit_set=wires.limit_set,
        applied=wires.limit_applied,
        reopened=wires.stream_opened,
        ready=ready,
        weights=weights,
        uses={n: registry[n].uses for n in names if registry[n].uses},
        units={n: registry[n].units for n in names if registry[n].units != 1},
    )
    handled = frozenset(names)  # another name's limit anywhere in the cluster stops nothing here
    ahead, slots = claim_ahead.build(
        config.concurrency,
        config.prefetch,
        limited=lambda: not handled.isdisjoint(limit_gate.restricting),
    )
    return Gate(limit_gate, SlotReleases(driver, clock, limit_gate), ahead, slots)


def build(
    driver: AsyncDriver,
    clock: Clock,
    config: WorkerConfig,
    *,
    worker_id: str,
    gate: Gate,
    queue: ClaimQueue,
    inflight: InFlight,
    assignment: Assignment,
    sink: QueueSink,
    runs: RunStarter,
    stats: WorkerStats,
    lifecycle: Lifecycle,
    wake: asyncio.Event,
    emit: Emitter,
    wires: Wires,
) -> Claiming:
    """The claim path: its strategies, its main loop, the recount of a changed limit."""
    calls = ClaimCalls(driver, clock, worker_id=worker_id, ignore=sink.ignore)
    wires.unopened.connect(calls.met_unopened)
    limited_claims = LimitedClaims(
        driver,
        calls,
        clock,
        gate=gate.gate,
        releases=gate.releases,
        sink=sink,
        inflight=inflight,
        runs=runs,
        stats=stats,
        wake=wake,
    )
    claimer = Claimer(
        clock,
        calls,
        limited_claims,
        concurrency=config.concurrency,
        ahead=gate.ahead,
        queue=queue,
        inflight=inflight,
        assignment=assignment,
        sink=sink,
        gate=gate.gate,
        runs=runs,
        stats=stats,
        lifecycle=lifecycle,
        wake=wake,
    )
    wires.capacity.measure_with(claimer.capacity)
    wires.run_started.connect(queue.discard)  # a started run's key leaves the claim queue
    wires.run_ended.connect(gate.ahead.ran)  # how long runs take: whether to claim ahead
    recount = Recount(
        driver,
        clock,
        worker_id,
        gate=gate.gate,
        inflight=inflight,
        runs=runs,
        emit=emit,
        changed=wires.limit_applied,
    )
    return Claiming(claimer, (gate.gate, recount))


__all__ = ["Claiming", "Gate", "build", "gate"]
