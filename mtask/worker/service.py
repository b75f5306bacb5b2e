"""The one shape of the worker's side loops, and the skeleton the periodic ones share.

A ``Service`` has a ``name`` and an ``async run()`` that runs for as long as the worker lives;
the ``Worker`` supervises a list of them (one dying stops the worker loudly). A
``PeriodicService`` is the skeleton that five loops used to write by hand: wait, do one round
(``run_once``, which tests call directly), log a storage error and try again next round. A
round never raises a storage error out of ``run``: MongoDB being away is weather, not a crash.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import ClassVar, Protocol

from mtask.errors import StorageError


class Service(Protocol):
    """A supervised side loop of the worker."""

    @property
    def name(self) -> str: ...

    async def run(self) -> None: ...


class PeriodicService:
    """``run``: forever ``wait()`` then ``run_once()``; a storage error is logged, not raised.

    Subclasses set ``name``, ``failure`` (what the warning says) and, if rounds start at once,
    ``run_first``; they override ``wait`` when a round can also be triggered by an event.
    """

    name: ClassVar[str] = "service"
    failure: ClassVar[str] = "failed, will retry"
    errors: ClassVar[tuple[type[Exception], ...]] = (StorageError,)
    run_first: ClassVar[bool] = False
    logger: ClassVar[str | None] = None
    """The logger's name, where it is not the class's module (a name operators filter on)."""
    interval: float = 1.0

    async def run_once(self) -> None:
        raise NotImplementedError

    async def wait(self) -> None:
        await asyncio.sleep(self.interval)

    async def run(self) -> None:
        log = logging.getLogger(self.logger or type(self).__module__)
        skip_wait = self.run_first
        while True:
            if not skip_wait:
                await self.wait()
            skip_wait = False
            try:
                await self.run_once()
            except self.errors as exc:
                log.warning("%s: %s", self.failure, exc, extra={"service": self.name})


async def event_or_timeout(event: asyncio.Event, seconds: float | None) -> bool:
    """Wait until ``event`` is set or ``seconds`` pass; True if it was set."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            await event.wait()
    return event.is_set()


async def first_set(events: tuple[asyncio.Event, ...], seconds: float | None) -> None:
    """Wait until one of ``events`` is set or ``seconds`` pass."""
    waits = [asyncio.ensure_future(event.wait()) for event in events]
    try:
        await asyncio.wait(waits, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()
