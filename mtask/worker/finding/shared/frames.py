"""What the relay says to one of its workers, frame by frame (``RelayFrames``): keys handed
(queued by ``Placement.hand``), ``OPEN`` (dispatched from now on), ``OWN`` (find your own work
from the relay's events), ``STANDBY`` (watch the lease), a group's run ended, or an event (a
task's, while alone with the relay; a control's, a limit's, a schedule's). Each may move the
worker's ``SubscriberState`` (through ``SharedStream._enter``, the one place it changes).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

from mtask.clock import Clock
from mtask.worker.finding.finder import Finder
from mtask.worker.finding.shared import wire
from mtask.worker.finding.shared.holder import RelayHolder
from mtask.worker.finding.shared.reporter import Reporter
from mtask.worker.finding.shared.subscriber_state import SubscriberState


class RelayFrames:
    """One worker's reading of its relay's frames; ``state`` and ``enter`` are its stream's."""

    def __init__(
        self,
        finder: Finder,
        holder: RelayHolder,
        reports: Reporter,
        clock: Clock,
        state: Callable[[], SubscriberState],
        enter: Callable[[SubscriberState], None],
    ) -> None:
        self.finder = finder
        self.holder = holder
        self.reports = reports
        self.clock = clock
        self.state = state
        self.enter = enter

    async def consume(
        self,
        next_frame: Callable[[], Awaitable[Mapping[str, Any] | None]],
        send: Callable[[dict[str, Any]], None],
        following: Callable[[], str],
        watch: asyncio.Task[None] | None = None,
        first: asyncio.TimerHandle | None = None,
    ) -> None:
        self.reports.connect(send, list(self.reports.names()))
        try:
            async for frame in _frames(next_frame, watch):
                if first is not None:
                    first.cancel()  # heard from it: no longer left alone after FIRST_FRAME
                await self.on_frame(frame, following())
        finally:
            if self.state() in (SubscriberState.DISPATCHED, SubscriberState.RELAY_EVENTS):
                self.enter(SubscriberState.BETWEEN)  # said of this relay: the next one anew
            self.reports.disconnect()

    async def on_frame(self, frame: Mapping[str, Any], relay_id: str) -> None:
        """One frame from the relay (``wire``)."""
        says, keys = wire.says(frame), wire.handed(frame)
        if says == "open":
            if self.state() is SubscriberState.DISPATCHED:
                self.reports.sync()  # its stream (re)opened, perhaps past events: counts agree
            # a subscription (re)starts, or its relay's stream reopened: a limit's change sent
            # before then reached no frame of this worker, so every limit is read again (as
            # an own stream's opening does); the gate's periodic read is a bound, not the path
            self.finder.others.opened()
        if keys is not None or says == "open":
            self.enter(SubscriberState.DISPATCHED)
        if keys is not None:
            self._handed(keys)
        elif says == "own":  # alone with the relay: its events follow, find work yourself
            self.enter(SubscriberState.RELAY_EVENTS)
            await self.finder.opened()
        elif says == "standby":
            self.holder.stand_by(relay_id)
        elif (group := wire.freed(frame)) is not None:
            self.finder.others.group_freed(*group)  # a run of a group it waits for ended
        elif says is None:  # a task's event (alone), or a control, limit or schedule's
            self.finder.on_change(frame)
            if self.state() is not SubscriberState.DISPATCHED:
                await asyncio.sleep(0)  # let a woken claimer send its claim first
                await self.finder.settle()

    def _handed(self, keys: list[wire.Handed]) -> None:
        now = self.clock.now()
        self.reports.received(len(keys))
        for k in keys:
            if not self.finder.placement.hand(
                k.key, k.name, k.priority, k.worker_timeout_ms, now, k.group
            ):
                self.reports.missed(k.key)  # it runs it already, for another worker


async def _frames(
    next_frame: Callable[[], Awaitable[Mapping[str, Any] | None]],
    watch: asyncio.Task[None] | None,
) -> AsyncIterator[Mapping[str, Any]]:
    """The frames until the relay lets go (``None``); a lease watch that ends raises here."""
    while True:
        if watch is None:
            frame = await next_frame()
        else:
            reading = asyncio.ensure_future(next_frame())
            try:
                await asyncio.wait({reading, watch}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                if not reading.done():  # the watch ended, or this was cancelled
                    reading.cancel()
                    with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                        await reading
            if watch.done():
                watch.result()  # RelaySilent (or what broke the watch)
            frame = reading.result()
        if frame is None:
            return
        yield frame
