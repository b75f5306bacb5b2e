"""A whole task's deadline (``options.deadline``): its run is stopped there.

A task published with a deadline fails for good once it passes, whatever it is doing: a run
is stopped at the deadline (``passed``: the executor stops it, and its outcome is a permanent
FAIL saying so, ``RunOutcomes.stopped``), and a run claimed after it is stopped before its
handler begins. A task that waits (a sleep, a signal, children) or backs off before a retry is
claimed again by its deadline at the latest (``store.outcomes.by_deadline``), so it never
outlives it by more than a claim. A run of a task without a deadline costs one look at its
options here, nothing more.
"""

from __future__ import annotations

import asyncio
import datetime as dt

from mtask.clock import Clock
from mtask.worker.inflight import ActiveRun
from mtask.worker.wiring import Signal


class TaskDeadlines:
    """One timer per run whose task has a deadline; ``passed`` is told of a run whose
    deadline came (on the loop)."""

    def __init__(self, clock: Clock, passed: Signal[[ActiveRun]]) -> None:
        self.clock = clock
        self.passed = passed
        self._timers: dict[str, asyncio.TimerHandle] = {}

    def watch(self, run: ActiveRun) -> None:
        """A run started: stop it at its task's deadline (at once, if that passed)."""
        if run.deadline is None:
            return
        left = (run.deadline - self.clock.now()).total_seconds()
        if left <= 0:
            self.passed(run)  # before its handler begins
            return
        loop = asyncio.get_running_loop()
        self._timers[run.run_id] = loop.call_later(left, self._fire, run)

    def forget(self, run: ActiveRun) -> None:
        """The run ended."""
        timer = self._timers.pop(run.run_id, None)
        if timer is not None:
            timer.cancel()

    def _fire(self, run: ActiveRun) -> None:
        self._timers.pop(run.run_id, None)
        if run.stop_reason is None:
            self.passed(run)


def deadline_of(options: object) -> dt.datetime | None:
    """A claimed task's deadline, if its options hold one (aware, as BSON gives it back)."""
    deadline = options.get("deadline") if isinstance(options, dict) else None
    if not isinstance(deadline, dt.datetime):
        return None
    return deadline if deadline.tzinfo is not None else deadline.replace(tzinfo=dt.UTC)
