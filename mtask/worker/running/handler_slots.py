"""The worker's handler slots (``RunSlots``), which only a run claimed ahead waits for; one
that waits too long is given back (``GiveBack``: recorded RELEASED). How many runs are claimed
ahead is the claim side's (``claiming/ahead.py``)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class GiveBack(Exception):
    """A run claimed ahead waited longer than the bound for its slot: record it RELEASED."""


class RunSlots:
    """The worker's ``concurrency`` handler slots, which only a run claimed ahead waits for.

    ``give_back_after``: a run that would wait longer raises ``GiveBack`` (``None``: it waits
    as long as it takes). A run that finds a slot free takes it at once, with no timer."""

    def __init__(
        self,
        concurrency: int,
        give_back_after: float | None = None,
        on_give_back: Callable[[], None] = lambda: None,
    ) -> None:
        self._free = asyncio.Semaphore(concurrency)
        self.give_back_after = give_back_after
        self.on_give_back = on_give_back

    async def __aenter__(self) -> None:
        if self.give_back_after is None or not self._free.locked():
            await self._free.acquire()
            return
        try:
            async with asyncio.timeout(self.give_back_after):
                await self._free.acquire()
        except TimeoutError:
            self.on_give_back()
            raise GiveBack from None

    async def __aexit__(self, *exc: object) -> None:
        self._free.release()
