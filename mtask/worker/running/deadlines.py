"""Each run stopped when its lease has run out by this process's own clock (``Deadlines``).

A run must stop before any other worker can take its task over: after a freeze (SIGSTOP, a VM
pause) it is stopped by the first timer that fires, not by a ping answered later, and no ping
success is assumed while MongoDB cannot be reached. One timer serves every run: it is set for
the earliest lease end among the runs in flight, and when it fires it stops the runs whose
lease (as the pinger last extended it) has ended and is set again for the next. A run that
starts costs a look at its lease end, not a timer of its own: the runs of one claim end their
leases together, after the ones before them.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Iterable
from typing import Protocol

from mtask.worker.inflight import ActiveRun


class Leases(Protocol):
    def expiry(self, run_id: str) -> float | None:
        """When the run's lease runs out at the earliest (the loop's clock); None if not
        pinged."""


class Deadlines:
    """The timer of the runs' lease ends. ``runs``: the runs whose handler has not ended;
    ``ran_out``: called on the loop for each run whose lease ended before a ping extended it
    (it stops the run)."""

    def __init__(
        self,
        leases: Leases,
        runs: Callable[[], Iterable[ActiveRun]],
        ran_out: Callable[[ActiveRun], None],
    ) -> None:
        self.leases = leases
        self.runs = runs
        self.ran_out = ran_out
        self._timer: asyncio.TimerHandle | None = None
        self._at = math.inf
        """When the timer fires (``inf``: no timer)."""

    def watch(self, run: ActiveRun) -> None:
        """A run started: the timer fires by its lease's end."""
        expiry = self.leases.expiry(run.run_id)
        if expiry is not None and expiry < self._at:
            self._set(expiry)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._at = None, math.inf

    def _set(self, at: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._at = at
        self._timer = asyncio.get_running_loop().call_at(at, self._fire)

    def _fire(self) -> None:
        self._timer, self._at = None, math.inf
        now = asyncio.get_running_loop().time()
        following = math.inf
        for run in list(self.runs()):
            if run.stop_reason:
                continue
            expiry = self.leases.expiry(run.run_id)
            if expiry is None:
                continue
            if now < expiry:  # pinged meanwhile (or not yet due)
                following = min(following, expiry)
            else:
                self.ran_out(run)
        if following < math.inf and following < self._at:
            self._set(following)
