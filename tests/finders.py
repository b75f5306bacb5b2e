"""A worker's ``Finder`` for a few names, without a worker around it (unit and contract
tests of placing, applying events and sweeping)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mtask.clock import Clock
from mtask.worker.claim_queue import ClaimQueue
from mtask.worker.finding.finder import Finder, Others
from mtask.worker.finding.placement import Placement, WorkerScope
from mtask.worker.finding.scan import Scanner
from mtask.worker.presence import Assignment


def finder_for(
    driver: Any,
    clock: Clock,
    names: list[str],
    *,
    worker_id: str = "w1",
    queue: ClaimQueue | None = None,
    in_flight: Callable[[str], bool] = lambda key: False,
    wake: Callable[[], None] = lambda: None,
    assignment: Assignment | None = None,
    others: Others | None = None,
) -> Finder:
    """``driver`` may be ``None`` where nothing is read or written."""
    scope = WorkerScope(worker_id, assignment or Assignment(tuple(names)))
    queue = ClaimQueue(100) if queue is None else queue
    placement = Placement(queue, scope, in_flight=in_flight, wake=wake)
    return Finder(Scanner(driver, placement, clock), others or Others())
