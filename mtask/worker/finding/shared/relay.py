"""One change stream and one claim queue for every worker of a tasks collection, on any host
(``--stream shared``): the relay.

With a stream and a queue per worker, mongod scanned every write once per stream and every
worker queued every task, so several raced for each: the server's CPU and the claim attempts
per task grew with the number of workers and hosts (bench W9, W9H). Here one worker process
holds the *relay*, chosen by a lease in MongoDB (``store.relays``: taken and renewed on the
server's clock): the one change stream, the claim queue of every subscriber's names and its
``Dispatcher``, which hands each due task to one subscriber with credit, its own worker
included. Relay and subscribers talk through MongoDB alone (``mailbox``, ``wire``).

- Events are hints, the claim decides, the sweep bounds a lost wake-up. The relay's queue
  rescans each time its stream (re)opens and every sweep; a subscriber that says hello gets
  ``{"relay": "open"}`` and from then on its tasks from the relay.
- The relay's stream carries its subscribers' claims and successes (their ``last_write``
  tags name them): the dispatcher reads them, and the subscribers do not report them. While the
  relay's own worker is alone, its stream leaves that worker's out, as an own stream does; the
  stream is reopened with the other filter when that changes, resuming after its last event
  (``Position.switch``: no rescan). Until the reopen (one getMore at most) the old filter still
  leaves out the own worker's claims and successes: a key handed to it meanwhile waits out its
  hand-over, and a short count of its successes is synced (``credit``).
- The change events of ``controls``, ``limits`` and ``schedules`` go to every subscriber.
- While the relay's own worker is its only subscriber (one worker: a small deployment's common
  case), nothing is handed out: the relay passes that worker its task events as an own stream
  would (``{"relay": "own"}``). When another subscriber comes, the relay's queue scans and
  hands out again.
- A slow subscriber never blocks the relay (``channels``: bounded, then dropped). A subscriber
  that leaves handed keys unacknowledged is let go (``credit.SILENT_SUBSCRIBER``); its keys
  come back.
- A relay that cannot renew its lease for ``LEASE_TTL`` seconds stops. Its subscribers see the
  lease go stale (``subscriber``) and find their own work until one of them holds the lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import time
import uuid
from collections.abc import Mapping
from typing import Any

from pymongo.errors import PyMongoError

from mtask import events
from mtask.errors import StorageError
from mtask.limits import group_slot
from mtask.slots import is_group_slot
from mtask.store import relays
from mtask.worker.finding.changes import event_key, lock_freed, lock_notice
from mtask.worker.finding.protocols import ClaimsBack
from mtask.worker.finding.shared import mailbox
from mtask.worker.finding.shared.channels import InboxChannel, LocalChannel, SubscriberChannel
from mtask.worker.finding.shared.dispatch import Dispatcher
from mtask.worker.finding.shared.wire import LET_GO, OPEN, OWN, apply_report, parse_hello
from mtask.worker.finding.stream import OTHER_COLLECTIONS, follow, stream_pipeline

log = logging.getLogger(__name__)

LAST_FRAME = {"f": LET_GO}
"""Written into an inbox before the relay drops it: it wakes a tail's waiting ``getMore``, and
the subscription ends with it (a drop alone does not wake it)."""

SUBSCRIBER_BUFFER = 4 * 1024 * 1024
"""Bytes the relay buffers for one subscriber before it drops it."""
LEASE_TTL = 10.0
"""Seconds a relay's lease lasts from its last renewal."""
RENEW_EVERY = 2.0
INBOX_SWEEP = 600.0
"""Seconds between two sweeps of inboxes nobody reads (made longer ago than this)."""


class LeaseLost(Exception):
    """The relay's lease is another's now, or could not be renewed in time."""


class Relay:
    """The change stream and claim queue of one tasks collection, for every subscriber."""

    local: dict[str, Relay] = {}
    """The relays held in this process, by id: a worker on the same event loop subscribes to
    its relay directly (``LocalChannel``)."""

    def __init__(
        self, database: Any, tasks: str, owner: str, buffer: int, dispatcher: Dispatcher
    ) -> None:
        self.database = database
        self.tasks = tasks
        self.owner = owner
        """The worker id of the worker whose process holds the relay."""
        self.id = f"{owner}/{uuid.uuid4().hex[:12]}"
        """This relay's id: the lease names it, subscribers address their reports to it."""
        self.buffer = buffer
        self.dispatcher = dispatcher
        self.subscribers: dict[SubscriberChannel, str] = {}
        """Every subscriber's channel and worker id."""
        self.inboxes: dict[str, InboxChannel] = {}
        """The subscribers in other processes, by subscription (reports name it)."""
        self.loop: asyncio.AbstractEventLoop | None = None
        self.open = False
        self.position = events.Position(fresh_when_lost=True)
        self.excluded: tuple[str, ...] = ()
        """The workers whose claims and successes the stream in use leaves out: the relay's
        own worker while it is the only subscriber, else none."""
        self.direct: LocalChannel | None = None
        """The relay's own worker, while it is the only subscriber: it gets the task events."""
        self.dropped = 0
        self.restarts = 0

    @classmethod
    async def acquire(
        cls, driver: Any, database: Any, tasks: str, owner: str, buffer: int, dispatcher: Dispatcher
    ) -> Relay | None:
        """The relay, if this process took the lease; ``None`` if another holds it."""
        relay = cls(database, tasks, owner, buffer, dispatcher)
        await driver.run(relays.ensure(tasks))
        if not await driver.run(relays.acquire(tasks, relay.id, int(LEASE_TTL * 1000))):
            return None
        relay.loop = asyncio.get_running_loop()
        cls.local[relay.id] = relay
        return relay

    async def run(self, driver: Any) -> None:
        """Follow the stream, hand out tasks, sweep and keep the lease until cancelled or the
        lease is lost; then let the lease go and every subscriber with it."""
        try:
            async with asyncio.TaskGroup() as group:
                group.create_task(self.dispatcher.run(), name="mtask-dispatch")
                group.create_task(self.dispatcher.host.sweep.run(), name="mtask-host-sweep")
                group.create_task(self._keep_lease(driver), name="mtask-relay-lease")
                group.create_task(self._read_reports(), name="mtask-relay-reports")
                await follow(self.database, self._pipeline, self, self.position)
        except* LeaseLost as lost:
            log.warning("the relay stops: %s", lost.exceptions[0])
        finally:
            if Relay.local.get(self.id) is self:
                del Relay.local[self.id]
            for subscriber in list(self.subscribers):
                subscriber.close()
            self.subscribers.clear()
            self.inboxes.clear()
            with contextlib.suppress(StorageError, asyncio.CancelledError):  # else it runs out
                await asyncio.shield(driver.run(relays.release(self.tasks, self.id)))

    async def _keep_lease(self, driver: Any) -> None:
        renewed = swept = time.monotonic()
        while True:
            await asyncio.sleep(RENEW_EVERY)
            try:
                held = await driver.run(relays.acquire(self.tasks, self.id, int(LEASE_TTL * 1000)))
            except StorageError as exc:
                if time.monotonic() - renewed >= LEASE_TTL - RENEW_EVERY:
                    raise LeaseLost(f"cannot renew the lease: {exc}") from exc
                continue
            if not held:
                raise LeaseLost("another relay holds the lease")
            renewed = time.monotonic()
            self.let_go_of_the_silent(renewed)
            if renewed - swept >= INBOX_SWEEP:
                swept = renewed
                keep = {inbox.inbox for inbox in self.inboxes.values()}
                before = self.dispatcher.now() - dt.timedelta(seconds=INBOX_SWEEP)
                await mailbox.drop_stale(self.database, self.tasks, keep, before, LAST_FRAME)

    def let_go_of_the_silent(self, now_mono: float) -> None:
        """Subscribers in other processes that left handed keys unacknowledged go."""
        for channel in self.dispatcher.accounts.silent(now_mono):
            if isinstance(channel, InboxChannel):
                log.info("subscription %s leaves keys unacknowledged", channel.subscription)
                self.remove(channel)

    # -- subscribers ------------------------------------------------------------------------

    def attach(
        self, worker_id: str, names: list[str], free: int, claims: ClaimsBack | None = None
    ) -> LocalChannel:
        """Subscribe a worker of this process and event loop (``claims``: its claims)."""
        local = LocalChannel(self.buffer, self.drop, claims)
        self._add(local, worker_id, names, free)
        return local

    def _add(self, channel: SubscriberChannel, worker_id: str, names: list[str], free: int) -> None:
        self.subscribers[channel] = worker_id
        near = isinstance(channel, LocalChannel)
        self.dispatcher.add(channel, worker_id, names, free, near=near)
        self._note_change()
        if self.open and self.direct is None:
            channel.send(OPEN)

    def remove(self, channel: SubscriberChannel) -> None:
        if self.subscribers.pop(channel, None) is not None:
            self.dispatcher.remove(channel)
            self._note_change()
        if isinstance(channel, InboxChannel) and self.inboxes.get(channel.subscription) is channel:
            del self.inboxes[channel.subscription]  # once (a writer that failed is closed too)
            if self.loop is not None:
                drop = mailbox.drop(self.database, channel.inbox, LAST_FRAME)
                self.loop.create_task(drop, name="mtask-drop-inbox")
        channel.close()

    def lost(self, channel: InboxChannel, exc: Exception) -> None:
        """A frame could not be written to the subscriber's inbox."""
        log.info("cannot write to a subscriber's inbox (%s); letting it go", exc)
        self.remove(channel)

    def drop(self, channel: SubscriberChannel) -> None:
        """A subscriber past its buffer: it goes (it says hello again)."""
        worker_id = self.subscribers.get(channel)
        if worker_id is not None and not channel.closing():
            self.dropped += 1
            log.warning("dropped a slow subscriber of the shared change stream: %s", worker_id)
        self.remove(channel)

    def _note_change(self) -> None:
        if self.excluded != self._excluded():
            self.position.switch()  # the other filter, from the next event on
        self._set_direct()

    def _excluded(self) -> tuple[str, ...]:
        return (self.owner,) if self._alone() is not None else ()

    def _alone(self) -> LocalChannel | None:
        """The relay's own worker, if it is the only subscriber."""
        if len(self.subscribers) != 1:
            return None
        [(channel, worker_id)] = self.subscribers.items()
        return channel if isinstance(channel, LocalChannel) and worker_id == self.owner else None

    def _set_direct(self) -> None:
        """Hand out or pass events on, as the subscribers are now."""
        alone = self._alone()
        if alone is self.direct:
            return
        was, self.direct = self.direct, alone
        if was is not None:
            was.first.forget()  # what it was handed is no longer waited for
        if not self.open:
            return
        if alone is not None:  # alone again: the relay's work is its own worker's
            self.dispatcher.clear()
            alone.send(OWN)
        elif was is not None:  # no longer alone: the relay's queue scans and hands out
            self.dispatcher.host.active = True
            self.dispatcher.host.request_rescan()
            self.broadcast(OPEN)

    def broadcast(self, doc: Mapping[str, Any]) -> None:
        """Queue ``doc`` for every subscriber."""
        for channel in list(self.subscribers):
            if channel.closing():
                self.drop(channel)
            else:
                channel.send(doc)

    # -- what subscribers say ---------------------------------------------------------------

    async def _read_reports(self) -> None:
        """The subscribers' hellos, reports and goodbyes, from the relay's inbox (made if
        missing); MongoDB away is weather: read again."""
        query = {"$or": [{"to": self.id}, dict(mailbox.MARKER)]}
        name = mailbox.reports_name(self.tasks)
        while True:
            try:
                reports = await mailbox.ensure_capped(self.database, name, mailbox.REPORTS_BYTES)
                async for doc in mailbox.tail(reports, query):
                    self._on_report(doc)
            except PyMongoError as exc:
                log.warning("reading the subscribers' reports failed, again: %s", exc)
                await asyncio.sleep(0.5)

    def _on_report(self, doc: Mapping[str, Any]) -> None:
        subscription, message = doc.get("from"), doc.get("f")
        if not isinstance(subscription, str) or not isinstance(message, Mapping):
            return
        inbox = self.inboxes.get(subscription)
        if message.get("hello") is not None:
            self._hello(subscription, message, inbox)
        elif inbox is None:
            return  # an earlier subscription, let go: its tail ended, it says hello again
        elif message.get("bye"):
            self.remove(inbox)
        else:
            try:
                apply_report(self.dispatcher, inbox, message)
            except (TypeError, ValueError) as exc:
                log.warning("a subscriber's report makes no sense (%s); letting it go", exc)
                self.remove(inbox)

    def _hello(self, subscription: str, hello: Mapping[str, Any], was: InboxChannel | None) -> None:
        parsed = parse_hello(self.tasks, hello)
        if parsed is None:
            return
        for old in [
            c for c in self.inboxes.values() if self.subscribers.get(c) == parsed.worker_id
        ]:
            self.remove(old)  # a worker subscribes once: its earlier subscription is gone
        if was is not None:
            self.remove(was)
        channel = InboxChannel(
            self.database[parsed.inbox], subscription, self.buffer, self.drop, self.lost
        )
        self.inboxes[subscription] = channel
        self._add(channel, parsed.worker_id, parsed.names, parsed.free)

    # -- the stream (the relay is its Inbox) ------------------------------------------------

    def _pipeline(self) -> list[dict[str, Any]]:
        self.excluded = self._excluded()
        return stream_pipeline(self.tasks, self.excluded)

    async def opened(self) -> None:
        self.direct = self._alone()
        if self.direct is not None:
            self.dispatcher.clear()
            self.open = True
            self.direct.send(OWN)  # its worker scans, as after an own stream's (re)open
            return
        await self.dispatcher.host.opened()  # the relay's queue scans: nothing slips between
        self.open = True
        self.broadcast(OPEN)

    def on_change(self, change: Mapping[str, Any]) -> None:
        ns = change.get("ns")
        collection = ns.get("coll") if isinstance(ns, Mapping) else None
        slot = event_key(change) if collection == "limits" else None
        if self.direct is None and isinstance(slot, str) and is_group_slot(slot):
            # a group's slot changes twice a run: only who waits for it hears of it
            waiters = self.dispatcher.slot_waiters.pop(slot, set())
            for channel in [c for c in self.subscribers if c in waiters]:
                channel.send(change)
        elif collection in OTHER_COLLECTIONS:
            self.broadcast(change)
        elif self.direct is not None:
            self.direct.hand(change)
        else:
            key = event_key(change)
            meta = self.dispatcher.host.known(key) if isinstance(key, str) else None
            if (freed := lock_freed(change, meta)) is not None:
                # a run of a sequence ended: who waits for its group hears of it
                waiters = self.dispatcher.slot_waiters.pop(group_slot(*freed), set())
                for channel in [c for c in self.subscribers if c in waiters]:
                    channel.send(lock_notice(freed))
            self.dispatcher.on_change(change)

    async def settle(self) -> None:
        if self.direct is None:
            await self.dispatcher.host.settle()
        elif not self.position.buffered:
            # Its own worker alone: the next read waits for the claim the last change led to
            # (at most CLAIM_WAIT), so that the claim is sent first; not between changes it
            # has read already, which its worker claims together.
            await self.direct.settled()

    def restarted(self) -> None:
        self.restarts += 1
