"""Claiming ahead: runs claimed beyond ``concurrency``, each waiting for a free slot, so a slot
that frees does not wait a claim's round trip (Celery's prefetch).

Celery's prefetch has a known cost: a run claimed ahead waits behind this worker's busy slots
while another worker may be idle. So by default (``prefetch="auto"``) a worker claims ahead only
while that wait is short, and gives back a run that waited too long:

- ``AdaptiveAhead`` claims up to ``concurrency`` runs ahead while its runs are shorter than a
  claim's round trip (both averaged over the last runs and claims), so each slot frees within
  about one round trip; until both were measured it takes runs to be short. Once off, its runs
  must get shorter than half a round trip before it claims ahead again (a workload on the
  boundary does not flap);
- ``RunSlots`` is where a run waits for its slot. With a bound (``GIVE_BACK_AFTER``), a run that
  waited longer raises ``GiveBack``: the run is recorded RELEASED (no retry spent; another
  worker may claim it at once), and ``AdaptiveAhead`` stops claiming ahead until its runs are
  short again. So a workload that turns from short runs to long ones costs at most one round
  of ``concurrency`` runs given back. While a name the worker runs is under a cluster-wide
  limit, ``AdaptiveAhead`` claims nothing ahead: a run claimed ahead would hold its slot of the
  limit while it waits.

``FixedAhead(n)`` is ``--prefetch N``: always up to ``n`` runs ahead, each waiting as long as its
slot takes (``0``: never ahead, and no run waits). docs/isolation.md says when to choose it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, Protocol

from mtask.worker.running.handler_slots import RunSlots

GIVE_BACK_AFTER = 1.0
"""Seconds a run claimed ahead (``prefetch="auto"``) waits for its slot before it is given back."""

_RUN_WEIGHT = 1 / 16
"""How much each run's duration moves the average (``AdaptiveAhead``)."""
_RTT_WEIGHT = 1 / 8
"""How much each claim's round trip moves the average."""


class ClaimAhead(Protocol):
    """How many runs the claimer may hold beyond its slots, and what it learns from."""

    def allowed(self) -> int:
        """Runs that may be claimed beyond ``concurrency`` now."""
        ...

    def claimed(self, round_trip: float) -> None:
        """A claim came back after ``round_trip`` seconds."""
        ...

    def ran(self, seconds: float) -> None:
        """A run's handler ended after ``seconds`` (from its slot to its end)."""
        ...


class FixedAhead:
    """``--prefetch N``: always ``n`` ahead."""

    def __init__(self, n: int) -> None:
        self.n = n

    def allowed(self) -> int:
        return self.n

    def claimed(self, round_trip: float) -> None:
        pass

    def ran(self, seconds: float) -> None:
        pass


class AdaptiveAhead:
    """``prefetch="auto"``: ``concurrency`` ahead while runs are shorter than a claim's round
    trip (or not yet measured), none otherwise."""

    def __init__(
        self,
        concurrency: int,
        give_back_after: float = GIVE_BACK_AFTER,
        limited: Callable[[], bool] = lambda: False,
    ) -> None:
        self.concurrency = concurrency
        self.give_back_after = give_back_after
        self.limited = limited
        """Whether a name the worker runs is under a cluster-wide limit (``LimitGate``): then
        nothing is claimed ahead, since a run claimed ahead would hold its slot of the limit
        while it waits."""
        self.run_s: float | None = None
        """The runs' average duration (seconds)."""
        self.round_trip_s: float | None = None
        """The claims' average round trip (seconds)."""
        self.on = True
        """Until a run and a claim were measured, runs are taken to be short: a worker's
        credit with the relay then does not change (a report to say so) when its first runs
        are (docs/isolation.md)."""
        self.given_back = 0
        """Runs given back for waiting too long (``RunSlots``)."""

    def allowed(self) -> int:
        return self.concurrency if self.on and not self.limited() else 0

    def claimed(self, round_trip: float) -> None:
        rtt = self.round_trip_s
        self.round_trip_s = round_trip if rtt is None else rtt + (round_trip - rtt) * _RTT_WEIGHT
        self._decide()

    def ran(self, seconds: float) -> None:
        mean = self.run_s
        self.run_s = seconds if mean is None else mean + (seconds - mean) * _RUN_WEIGHT
        self._decide()

    def gave_back(self) -> None:
        """A run waited ``give_back_after`` for its slot: the slots are held by longer runs
        than measured. Count it as a run that long, so claiming ahead stops until runs are
        short again."""
        self.given_back += 1
        self.run_s = max(self.run_s or 0.0, self.give_back_after)
        self.on = False

    def _decide(self) -> None:
        run, rtt = self.run_s, self.round_trip_s
        if run is None or rtt is None:
            return
        # on below half a round trip, off above one: a workload near the line does not flap
        self.on = run < rtt if self.on else run < rtt / 2


def build(
    concurrency: int, prefetch: int | Literal["auto"], limited: Callable[[], bool]
) -> tuple[ClaimAhead, RunSlots | None]:
    """The claimer's ``ClaimAhead`` for ``WorkerConfig.prefetch``, and the slots its runs wait
    on (``None`` for ``0``: no run ever waits, so none passes a semaphore). ``limited``: whether
    a cluster-wide limit is set (``auto`` claims nothing ahead then)."""
    if prefetch == "auto":
        adaptive = AdaptiveAhead(concurrency, limited=limited)
        return adaptive, RunSlots(concurrency, adaptive.give_back_after, adaptive.gave_back)
    return FixedAhead(prefetch), RunSlots(concurrency) if prefetch else None
