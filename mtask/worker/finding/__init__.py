"""Finding work: which tasks a worker claims next, and when.

Parts, each behind a narrow protocol (``protocols``):

- ``placement`` — where a known task sits in the claim queue, and whose it is (pure);
- ``scan`` — the scan, the sweep, lookups and quarantine (through the driver);
- ``changes`` — one change event applied to a placement;
- ``finder`` — a worker's own finding: the ``Inbox`` of its source, the ``QueueSink`` of its
  claimer, gate and recorder;
- ``stream`` — the change stream's pipeline, ``follow`` on the one reopen loop of
  ``mtask.follow.events``, and ``OwnStream``;
- ``shared/`` — one relay for the cluster (``--stream shared``): ``relay``, ``dispatch``,
  ``host_queue``, ``credit``, ``channels``, ``mailbox``, ``wire`` on the relay's side, and
  ``subscriber`` on every worker's.

``build`` makes a worker's finding parts for either way of finding work: the choice is which
parts are made, not a flag the parts consult.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from mtask import driver
from mtask.clock import Clock
from mtask.worker.claim_queue import ClaimQueue
from mtask.worker.finding.finder import Finder, Others, ReportingSink
from mtask.worker.finding.placement import Placement, WorkerScope
from mtask.worker.finding.protocols import ClaimsBack, QueueSink
from mtask.worker.finding.scan import Scanner, Sweep, TopUp
from mtask.worker.finding.shared.subscriber import SharedStream
from mtask.worker.finding.stream import OwnStream
from mtask.worker.presence import Assignment
from mtask.worker.service import Service
from mtask.worker.wiring import Signal


@dataclass(frozen=True)
class Finding:
    """A worker's finding parts, made together."""

    finder: Finder
    sink: QueueSink
    """What the claimer, the limit gate and the recorder put tasks back into."""
    services: tuple[Service, ...]
    """What runs for it: an own stream, the sweep and the top-up, or the shared stream."""
    shared: SharedStream | None
    """The worker's side of the shared stream, if it shares it."""

    def leads(self) -> bool:
        """Whether this worker runs the cluster's own duties (it holds the relay, or finds
        its work alone)."""
        return self.shared is None or self.shared.leads()

    def ranks(self) -> bool:
        """Whether this worker finds its own work now, its claims staggered by its peers (an
        own stream; a shared one whose relay hands it nothing): the heartbeat reads the peers
        only then."""
        return self.shared is None or self.shared.ranks()

    def state(self) -> dict[str, Any] | None:
        return None if self.shared is None else self.shared.heartbeat()

    @property
    def restarts(self) -> int:
        """Restarts of the change streams this worker follows (the relay's, if it holds it)."""
        relay = None if self.shared is None else self.shared.relay
        return self.finder.restarts + (0 if relay is None else relay.restarts)


def build(
    driver: driver.AsyncDriver,
    clock: Clock,
    *,
    stream: Literal["own", "shared"],
    worker_id: str,
    queue: ClaimQueue,
    assignment: Assignment,
    in_flight: Callable[[str], bool],
    wake: Callable[[], None],
    others: Others,
    capacity: Callable[[], int],
    freed: Signal[[]],
    claims: ClaimsBack | None = None,
    sweep_interval: float = 30.0,
    stagger_ms: float = 25.0,
) -> Finding:
    placement = Placement(
        queue,
        WorkerScope(worker_id, assignment),
        in_flight=in_flight,
        wake=wake,
        stagger=dt.timedelta(milliseconds=stagger_ms),
    )
    finder = Finder(Scanner(driver, placement, clock, sweep_interval=sweep_interval), others)
    if stream == "own":
        tasks = driver.collections["tasks"]
        own = OwnStream(tasks.database, tasks.name, worker_id, finder, claims)
        services = (own, Sweep.of(finder.scanner), TopUp(finder.scanner))
        return Finding(finder, finder, services, None)
    shared = SharedStream(
        driver, clock, worker_id, finder, capacity, claims=claims, new_queue=queue.like
    )
    freed.connect(shared.slot_freed)  # a slot freed: the relay may hand this worker more
    return Finding(finder, ReportingSink(finder, shared.reports), (shared,), shared)


__all__ = ["Finding", "Others", "build"]
