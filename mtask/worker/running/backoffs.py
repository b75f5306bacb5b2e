"""A run's back-off: when a handler raises ``BackOff``, the hold is written
(``mtask.store.holds.hold``) before its run is released, and this worker's view of the limits is
told at once."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable

from mtask.clock import Clock
from mtask.driver import AsyncDriver, Doc
from mtask.limits.holds import BackOff, held_until, target
from mtask.store.holds import hold


class Holds:
    """The worker's side of a back-off: the hold written (``hold``) before the run that raised
    ``BackOff`` is released, and this worker's view of the limits told at once (``applied``:
    its next claims of what is held take its slot; other workers hear of it by its event)."""

    def __init__(
        self,
        driver: AsyncDriver,
        clock: Clock,
        applied: Callable[[str, Doc], None] = lambda slot, doc: None,
    ) -> None:
        self.driver = driver
        self.clock = clock
        self.applied = applied

    async def hold(self, exc: BackOff, name: str, group: str | None) -> dt.datetime:
        """Hold what ``exc`` names for a run of ``name`` (in ``group``); returns until when.
        Raises ``InvalidTask`` (a group back-off of a task with no group) or ``StorageError``."""
        slot, held = target(exc, name, group)
        now = self.clock.now()
        until = now + dt.timedelta(seconds=exc.seconds)
        doc = await self.driver.run(hold(slot, held, until, now))
        self.applied(slot, doc)
        return max(until, held_until(doc, held, now) or until)  # a hold only moves later
