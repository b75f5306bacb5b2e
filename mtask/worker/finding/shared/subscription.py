"""One subscription to a relay in another process, through MongoDB: an inbox of its own that
it tails, its reports inserted into the relay's, and the relay's lease read while the relay is
quiet (``LOOK_EVERY``, and sooner once the relay is late: ``look_after``): a relay that stopped
renewing it (dead, frozen, cut off) for ``STALE_AFTER`` seconds, or lost it, is left
(``RelaySilent``). That look is the last resort: a relay that goes silent is taken over by its
standby within a second (``standby``), whose relay ends this subscription at once
(``wire.taken``: ``taken_by``)."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from pymongo.errors import OperationFailure

from mtask import driver
from mtask.clock import Clock
from mtask.errors import StorageError
from mtask.store import relays
from mtask.worker.finding.shared import mailbox, wire
from mtask.worker.finding.shared.lease import LEASE_TTL, RENEW_EVERY
from mtask.worker.service import event_or_timeout

LOOK_EVERY = 4.5
"""Seconds without a frame between two reads of the relay's lease."""
STALE_AFTER = 5.0
"""A relay that has not renewed its lease for this long (it renews every 2 s) is left."""
UNAUTHORIZED = 13


class RelaySilent(Exception):
    """The relay's lease went stale, or names another relay."""

    def __init__(self, relay_id: str, why: str) -> None:
        super().__init__(why)
        self.relay_id = relay_id


class NoInbox(Exception):
    """This worker may not make a capped collection: it cannot subscribe."""


LATE_AFTER = RENEW_EVERY + 0.5
"""A lease not renewed for this long has missed a renewal: the next look comes just after the
relay would go stale (``look_after``), not ``LOOK_EVERY`` later."""
LOOK_MARGIN = 0.25
"""Seconds past the moment a late relay goes stale at which it is looked at again."""


def look_after(ago: float) -> float:
    """Seconds from a look that found the lease renewed ``ago`` seconds before to the next look:
    ``LOOK_EVERY`` while the relay renews on time (an idle subscriber's reads stay as they
    were), and once it is late just after it would go stale. So a dead relay is left at most
    ``LATE_AFTER`` + ``LOOK_EVERY`` (7 s) after its last renewal, not ``STALE_AFTER`` +
    ``LOOK_EVERY`` (9.5 s); a late relay costs each subscriber one look more."""
    if ago < LATE_AFTER:
        return LOOK_EVERY
    return min(LOOK_EVERY, max(0.0, STALE_AFTER - ago) + LOOK_MARGIN)


async def renewed_ago(driver: driver.AsyncDriver, tasks: str, relay_id: str) -> float | None:
    """Seconds since ``relay_id`` renewed its lease of ``tasks`` (``None``: it does not hold
    it, or it ran out)."""
    ago: int | None = await driver.run(relays.renewed_ago(tasks, relay_id, int(LEASE_TTL * 1000)))
    return None if ago is None else ago / 1000


async def relay_alive(driver: driver.AsyncDriver, tasks: str, relay_id: str) -> bool:
    ago = await renewed_ago(driver, tasks, relay_id)
    return ago is not None and ago < STALE_AFTER


class Holder(Protocol):
    """This worker's side of holding the relay (``holder.RelayHolder``)."""

    taken_over: asyncio.Event

    async def take_if_free(self) -> object: ...


async def next_relay(driver: driver.AsyncDriver, holder: Holder, left: str) -> str:
    """After the relay ``left`` went silent: at each look (or at once when this worker takes a
    lease over as a standby), the relay that holds the lease once another does (``holder``
    takes it once it has run out), or ``left`` again once it renews it again (it was frozen,
    or cut off, for a while)."""
    tasks = driver.collections["tasks"].name
    while True:
        if await event_or_timeout(holder.taken_over, LOOK_EVERY):
            holder.taken_over.clear()  # (once: MongoDB away, the next try is a look later)
        try:
            await holder.take_if_free()
            relay = await driver.run(relays.holder(tasks))
            if relay is not None and relay != left:
                return relay  # another relay (perhaps this worker's): subscribe to it
            if relay == left and await relay_alive(driver, tasks, left):
                return relay
        except StorageError:
            continue


class InboxSubscription:
    def __init__(
        self,
        driver: driver.AsyncDriver,
        relay_id: str,
        worker_id: str,
        on_look: Callable[[], None],
        *,
        hello: Callable[[], Mapping[str, Any]] = dict,
        on_moved: Callable[[str], bool] = lambda relay_id: False,
    ) -> None:
        self.driver = driver
        self.relay_id = relay_id
        """The relay followed (another, once one took the lease over: ``on_moved``)."""
        tasks = driver.collections["tasks"]
        self.tasks = tasks.name
        self.database = driver.collections["inboxes"].database
        """The inbox database (``driver.inbox_database``): this inbox and the relay's."""
        self.subscription = f"{worker_id}/{uuid.uuid4().hex[:12]}"
        self.inbox = mailbox.inbox_name(self.tasks, self.subscription)
        self.on_look = on_look
        """Called at each look at the lease (the worker says a changed credit then)."""
        self.hello = hello
        """What the worker says in a hello: its id, names and credit."""
        self.on_moved = on_moved
        """Another relay took the lease (``wire.taken``): whether the worker follows it here,
        from this inbox (else the subscription ends: ``taken_by``)."""
        self.heard_at = float("-inf")
        """When (monotonic) the last frame came: a relay heard from within ``LATE_AFTER`` is
        alive, and its lease is not read."""
        self._failed: list[Exception] = []
        self._out = mailbox.Writer(
            self.database[mailbox.reports_name(self.tasks)], self._failed.append
        )
        self._frames: Any = None
        self.watch: asyncio.Task[None] | None = None
        self.taken_by: str | None = None
        """The relay that took the lease and ended this subscription (``wire.taken``)."""

    async def open(self, clock: Clock) -> None:
        """Make the inbox, say hello, tail."""
        try:
            inbox = await mailbox.ensure_capped(
                self.database, self.inbox, mailbox.INBOX_BYTES, at=clock.now()
            )
        except OperationFailure as exc:
            if exc.code == UNAUTHORIZED:
                raise NoInbox(f"cannot make an inbox: {exc}") from exc
            raise
        # capped before the first report: an insert would make it a plain collection
        reports = mailbox.reports_name(self.tasks)
        await mailbox.ensure_capped(self.database, reports, mailbox.REPORTS_BYTES)
        self._say_hello()
        self._frames = mailbox.tail(inbox)
        self.watch = asyncio.create_task(self._watch_lease(), name="mtask-relay-lease-watch")

    def send(self, message: dict[str, Any]) -> None:
        self._out.put({"to": self.relay_id, "from": self.subscription, "f": message})

    def _say_hello(self) -> None:
        self.send({"hello": wire.PROTOCOL, "inbox": self.inbox, **self.hello()})

    async def next_frame(self) -> Mapping[str, Any] | None:
        """The next frame, or ``None`` once the relay let go (it dropped the inbox), or
        another took the lease and the worker follows it otherwise (``taken_by``). A relay that
        took the lease over is followed from this inbox (a hello), its frames read on."""
        while True:
            if self._failed:
                raise self._failed[0]
            try:
                doc = await anext(self._frames)
            except StopAsyncIteration:
                return None
            self.heard_at = time.monotonic()
            frame = doc.get("f")
            if not isinstance(frame, Mapping):
                return {}
            by = wire.taken_by(frame)
            if by is None:
                return None if frame == wire.LET_GO else frame  # (then dropped, let go)
            if by == self.relay_id:
                continue  # (said again: followed already)
            if not self.on_moved(by):
                self.taken_by = by
                return None
            self.relay_id = by
            self._say_hello()

    async def close(self) -> None:
        """Stop watching and tailing, say goodbye, and write what is left."""
        if self.watch is not None:
            self.watch.cancel()
            await asyncio.gather(self.watch, return_exceptions=True)
        if self._frames is not None:
            with contextlib.suppress(RuntimeError):  # a read cancelled mid-way: it is closed
                await self._frames.aclose()
        self.send(dict(wire.BYE))
        await self._out.drain()
        self._out.close()

    async def _watch_lease(self) -> None:
        """Every ``LOOK_EVERY``: the worker's look (``on_look``), then a read of the relay's
        lease unless a frame came within ``LATE_AFTER``; while the relay is late, once more
        just after it would go stale (``look_after``), until it renewed or is left."""
        while True:
            await asyncio.sleep(LOOK_EVERY)
            self.on_look()
            ago = await self._lease_read()
            while ago is not None and ago >= LATE_AFTER:
                await asyncio.sleep(look_after(ago))
                ago = await self._lease_read()

    async def _lease_read(self) -> float | None:
        """Seconds since the relay renewed its lease, or ``None`` if a frame came within
        ``LATE_AFTER``; ``RelaySilent`` if it has gone stale or is another's."""
        if time.monotonic() - self.heard_at < LATE_AFTER:
            return None
        try:
            ago = await renewed_ago(self.driver, self.tasks, self.relay_id)
        except StorageError as exc:
            raise RelaySilent(self.relay_id, f"cannot read the lease: {exc}") from exc
        if ago is None or ago >= STALE_AFTER:
            raise RelaySilent(self.relay_id, "its lease went stale or changed hands")
        return ago
