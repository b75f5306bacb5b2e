"""The cluster's periodic chores (River's ``internal/maintenance/``): what one worker does for
all of them, on a timer, beside the wings.

- ``flow_sweep`` — what a crash or a race left undone in flows: outboxes, dependencies, flow
  parents held, and the children's count of a parent that missed its wake-up
  (``store.children.sweep``). It runs only on the relay holder (``--stream shared``: one sweep
  for the cluster); with own streams, on every worker;
- ``scheduler`` — fires due schedules. Every worker that runs schedules runs it (``fire`` is a
  compare-and-set: one publish of a tick wins), waking on the schedules' change events.

``build`` makes them for one worker.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mtask.clock import Clock
from mtask.driver import AsyncDriver
from mtask.registry import Registry
from mtask.worker.config import WorkerConfig
from mtask.worker.maintenance.flow_sweep import FlowSweep
from mtask.worker.maintenance.scheduler import POLL_SECONDS, Scheduler
from mtask.worker.service import Service
from mtask.worker.wiring import Signal

SHARED_SCHEDULES_POLL = 60.0
"""With the shared stream, the scheduler's bounding read (the relay passes the schedules' change
events on as they come; it wakes at each schedule's next tick in any case)."""


@dataclass(frozen=True)
class Maintenance:
    """One worker's chores, made together."""

    scheduler: Scheduler
    services: tuple[Service, ...]
    """What runs: the flow sweep, and the scheduler if the worker runs schedules."""


def build(
    driver: AsyncDriver,
    clock: Clock,
    config: WorkerConfig,
    registry: Registry,
    *,
    leads: Callable[[], bool],
    schedules_changed: Signal[[]],
) -> Maintenance:
    """The chores of one worker: ``leads`` says whether it sweeps now (the relay's holder, or
    a worker finding its own work); ``schedules_changed`` wakes the scheduler."""
    shared = config.stream == "shared"
    scheduler = Scheduler(
        driver,
        clock,
        list(registry.schedules.values()),
        poll=SHARED_SCHEDULES_POLL if shared else POLL_SECONDS,
    )
    schedules_changed.connect(scheduler.wake.set)
    sweep = FlowSweep(driver, clock, config.flow_sweep_interval, leads)
    return Maintenance(scheduler, (sweep, *([scheduler] if config.run_schedules else [])))


__all__ = ["FlowSweep", "Maintenance", "Scheduler", "build"]
