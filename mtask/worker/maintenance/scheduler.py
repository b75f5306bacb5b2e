"""The worker's scheduler loop: fires the schedules whose tick has come.

The schedule domain and its store operations are ``mtask.schedules``; this service only runs
them: once MongoDB answers it writes the registry's declared schedules, then each round fires
every due schedule (``schedules.fire``: publish idempotently, then advance with a
compare-and-set) and sleeps until the next tick, at most ``POLL_SECONDS``, or until the
finding parts report a change in the ``schedules`` collection.
"""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

from mtask.clock import Clock
from mtask.driver import AsyncDriver
from mtask.store.schedules import due, ensure_indexes, fire, next_due, put
from mtask.worker.service import PeriodicService, event_or_timeout

if TYPE_CHECKING:
    from mtask.schedules.definition import Schedule

POLL_SECONDS = 10.0
"""The longest a scheduler sleeps. A schedule added, changed or resumed wakes it at once (its
change event: ``wake``); the poll bounds a lost event, as the sweep does for tasks. (It was 1 s:
two reads a second per idle worker, a third of what an idle worker cost mongod.)"""


class Scheduler(PeriodicService):
    name: ClassVar[str] = "schedules"
    failure: ClassVar[str] = "scheduler cannot reach MongoDB, retrying"
    logger: ClassVar[str | None] = "mtask.worker.scheduler"  # the name operators filter on, kept
    run_first: ClassVar[bool] = True
    interval = POLL_SECONDS

    def __init__(
        self,
        driver: AsyncDriver,
        clock: Clock,
        declared: Sequence[Schedule],
        poll: float = POLL_SECONDS,
    ) -> None:
        self.driver = driver
        self.poll = poll
        """The longest it sleeps (a lost change event delays a schedule by this at most)."""
        self.clock = clock
        self.declared = list(declared)
        self._declared_written = False
        self.upcoming: dt.datetime | None = None
        """The next tick of any schedule, as of the last round (``None``: unknown)."""
        self.wake = asyncio.Event()
        """Set on a change event in ``schedules``: start a round at once."""

    async def run_once(self) -> None:
        self.upcoming = None
        if not self._declared_written:  # the registry's schedules, written once MongoDB answers
            await self.driver.run(ensure_indexes())
            for schedule in self.declared:
                await self.driver.run(put(schedule, self.clock.now()))
            self._declared_written = True
        for doc in await self.driver.run(due(self.clock.now())):
            await self.driver.run(fire(doc, self.clock.now()))
        self.upcoming = await self.driver.run(next_due())

    async def wait(self) -> None:
        wait = self.poll
        if self.upcoming is not None:
            wait = min(wait, max(0.0, (self.upcoming - self.clock.now()).total_seconds()))
        await event_or_timeout(self.wake, wait)
        self.wake.clear()  # after the wait: a change during the last round wakes it at once
