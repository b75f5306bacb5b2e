"""Where the relay's frames for one subscriber go: an inbox in MongoDB (a subscriber in any
other process, on any host) or a queue in memory (the worker of the relay's own event loop).
Both are bounded: past ``buffer`` bytes of unsent frames the subscriber is dropped (``on_full``)
and says hello again.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from mtask.worker.finding.protocols import ClaimsBack, NoClaims
from mtask.worker.finding.shared import mailbox, wire
from mtask.worker.finding.stream import ClaimsFirst

FRAME_BYTES = 256
"""What a frame counts for against a subscriber's buffer."""


class InboxChannel:
    """A subscriber in another process: frames inserted into its inbox, each once ``gate`` lets
    them (the relay's lease is fresh)."""

    def __init__(
        self,
        collection: Any,
        subscription: str,
        buffer: int,
        on_full: Callable[[InboxChannel], None],
        on_failed: Callable[[InboxChannel, Exception], None],
        gate: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.subscription = subscription
        self.buffer = buffer
        self.on_full = on_full
        self.writer = mailbox.Writer(collection, lambda exc: on_failed(self, exc), gate)

    @property
    def inbox(self) -> str:
        return str(self.writer.collection.name)

    def closing(self) -> bool:
        return self.writer.closed

    def send(self, doc: Mapping[str, Any]) -> None:
        if (len(self.writer) + 1) * FRAME_BYTES > self.buffer:
            self.on_full(self)
            return
        self.writer.put({"f": doc})

    def dispatch(self, entries: list[list[Any]]) -> None:
        self.send(wire.hand_out(entries))

    def close(self) -> None:
        self.writer.close()


class LocalChannel:
    """A subscriber in the relay's own process and event loop: frames handed over as the
    documents they are."""

    def __init__(
        self,
        buffer: int,
        on_full: Callable[[LocalChannel], None],
        claims: ClaimsBack | None = None,
    ) -> None:
        self.buffer = buffer
        self.on_full = on_full
        self.first = ClaimsFirst(NoClaims() if claims is None else claims)
        """Its worker's claims: ``settled`` waits for those begun since a change was handed."""
        self.items: collections.deque[Mapping[str, Any]] = collections.deque()
        self.ready = asyncio.Event()
        self.closed = False

    def closing(self) -> bool:
        return self.closed

    def send(self, doc: Mapping[str, Any]) -> None:
        if (len(self.items) + 1) * FRAME_BYTES > self.buffer:
            self.on_full(self)
            return
        self.items.append(doc)
        self.ready.set()

    def hand(self, change: Mapping[str, Any]) -> None:
        """A task's change event for the relay's own worker alone: ``settled`` then waits for
        the claims begun since the first one handed."""
        self.first.handed()
        self.send(change)

    def dispatch(self, entries: list[list[Any]]) -> None:
        self.send(wire.hand_out(entries))

    def close(self) -> None:
        self.closed = True
        self.ready.set()

    async def settled(self) -> None:
        """Return once the claims the changes handed since the last call led to (if any) are
        back, or after ``CLAIM_WAIT`` (``ClaimsFirst``): its worker shares this event loop."""
        await self.first.settled()

    async def next(self) -> Mapping[str, Any] | None:
        """The next frame, or ``None`` once closed (the relay went, or dropped it)."""
        while not self.items and not self.closed:
            self.ready.clear()
            await self.ready.wait()
        return None if self.closed else self.items.popleft()


SubscriberChannel = InboxChannel | LocalChannel
