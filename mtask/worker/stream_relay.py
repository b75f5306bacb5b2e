"""One change stream and one claim queue for every worker of a tasks collection, on any host
(``--stream shared``): the relay.

Every worker used to hold a change stream of its own. mongod scanned every write once per
stream and built every event once per worker, and every worker queued every task, so several
raced for each one: mongod's CPU and the claim attempts per task grew with the number of
workers and of hosts (bench W9, W9H). Here one worker process holds the *relay*, chosen by a
lease in MongoDB (``store.relays``: taken and renewed on the server's clock): the one change
stream, the claim queue of every worker's names and its dispatcher (``dispatch.py``), which
hands each due task to one subscribed worker with a free slot, itself included. The subscriber
claims it as before (``shared_stream.py``). Relay and subscribers talk through MongoDB alone
(``mailbox``): no protocol of our own between hosts.

- Events are hints, the claim decides, the sweep bounds a lost wake-up. The relay's queue
  rescans each time its stream (re)opens and every sweep; a subscriber that says hello gets
  ``{"relay": "open"}`` and from then on its tasks from the relay.
- The relay's stream leaves out its subscribers' claims and successes (their ``last_write``
  tags, as an own stream leaves out its worker's): they tell the relay instead. When a
  subscriber comes or goes the stream is reopened with the new tags, resuming after its last
  event (no gap, no rescan).
- The change events of ``controls``, ``limits`` and ``schedules`` go to every subscriber.
- While the relay's own worker is its only subscriber (one worker: the common case of a small
  deployment), nothing is handed out: the relay passes that worker its task events as an own
  stream would (``{"relay": "own"}``), at an own stream's cost. When another subscriber comes,
  the relay's queue scans and the relay hands out again; when it is alone again, its worker
  scans for itself.
- A slow subscriber never blocks the relay: frames are buffered per subscriber up to
  ``SUBSCRIBER_BUFFER`` bytes; past that the subscriber is dropped and says hello again.
- A subscriber silent for ``3 * KEEPALIVE`` seconds (dead, frozen, cut off) is let go, and the
  keys handed to it come back after ``HAND_OVER_TIMEOUT``.
- A relay that cannot renew its lease (frozen, cut off, MongoDB away) for ``LEASE_TTL``
  seconds stops; subscribers that hear nothing from it for ``shared_stream.SILENT`` seconds
  find their own work meanwhile, and one of them takes the lease once it has run out.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import datetime as dt
import logging
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from pymongo.errors import PyMongoError

from mtask.errors import StorageError
from mtask.store import relays
from mtask.worker import mailbox
from mtask.worker.dispatch import Dispatcher
from mtask.worker.relay_wire import KEEPALIVE, OPEN, OWN, PROTOCOL, TICK
from mtask.worker.stream import Reopen, follow, stream_pipeline
from mtask.worker.watcher import Sweep

log = logging.getLogger(__name__)

SUBSCRIBER_BUFFER = 4 * 1024 * 1024
"""Bytes the relay buffers for one subscriber before it drops it."""
YIELD_EVERY = 64
"""Events the relay takes before it lets the event loop turn (subscribers read meanwhile)."""
OTHER_COLLECTIONS = ("controls", "limits", "schedules")
LEASE_TTL = 10.0
"""Seconds a relay's lease lasts from its last renewal."""
RENEW_EVERY = 2.0
INBOX_SWEEP = 600.0
"""Seconds between two sweeps of inboxes nobody reads (made longer ago than this)."""
FRAME_BYTES = 256
"""What a frame counts for against a subscriber's buffer."""


class LeaseLost(Exception):
    """The relay's lease is another's now, or could not be renewed in time."""


class _Inbox:
    """A subscriber in another process (on any host): frames inserted into its inbox."""

    def __init__(self, relay: Relay, collection: Any, subscription: str) -> None:
        self.relay = relay
        self.subscription = subscription
        self.heard = time.monotonic()
        self.writer = mailbox.Writer(collection, lambda exc: relay.lost(self, exc))

    def backlog(self) -> int:
        return len(self.writer) * FRAME_BYTES

    def closing(self) -> bool:
        return self.writer.closed

    def send(self, doc: Mapping[str, Any]) -> None:
        if self.backlog() + FRAME_BYTES > self.relay.buffer:
            self.relay.drop(self)
            return
        self.writer.put({"f": doc})

    def dispatch(self, entries: list[list[Any]]) -> None:
        self.send({"d": entries})

    def tick(self) -> None:
        self.send(TICK)

    def close(self) -> None:
        self.writer.close()


class Local:
    """A subscriber in the relay's own process and event loop: frames handed over as the
    documents they are, bounded like an inbox."""

    def __init__(self, relay: Relay | None = None) -> None:
        self.relay = relay
        self.items: collections.deque[Mapping[str, Any]] = collections.deque()
        self.ready = asyncio.Event()
        self.closed = False

    def backlog(self) -> int:
        return len(self.items) * FRAME_BYTES

    def closing(self) -> bool:
        return self.closed

    def send(self, doc: Mapping[str, Any]) -> None:
        if self.relay is not None and self.backlog() + FRAME_BYTES > self.relay.buffer:
            self.relay.drop(self)
            return
        self.items.append(doc)
        self.ready.set()

    def dispatch(self, entries: list[list[Any]]) -> None:
        self.send({"d": entries})

    def tick(self) -> None:
        """Nothing: a worker on the relay's own event loop stops when the loop does."""

    def close(self) -> None:
        self.closed = True
        self.ready.set()

    async def next(self) -> Mapping[str, Any] | None:
        """The next frame, or ``None`` once closed (the relay went, or dropped it)."""
        while not self.items and not self.closed:
            self.ready.clear()
            await self.ready.wait()
        return None if self.closed else self.items.popleft()


Subscriber = _Inbox | Local


class Relay:
    """The change stream and claim queue of one tasks collection, for every subscribed worker."""

    local: dict[str, Relay] = {}
    """The relays held in this process, by id: a worker on the same event loop subscribes to
    its relay directly (``Local``)."""

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
        self.subscribers: dict[Subscriber, str] = {}
        self.by_subscription: dict[str, _Inbox] = {}
        self.loop: asyncio.AbstractEventLoop | None = None
        self.open = False
        self.excluded: tuple[str, ...] = ()
        """The workers whose claims and successes the stream in use leaves out."""
        self.direct: Local | None = None
        """The relay's own worker, while it is the only subscriber: it gets the task events."""
        self._switch = False
        self._unyielded = 0
        self.dropped = 0

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

    async def run(self, driver: Any, restarted: Callable[[], None] = lambda: None) -> None:
        """Follow the stream, hand out tasks, sweep and keep the lease until cancelled or the
        lease is lost; then let the lease go and every subscriber with it."""
        try:
            async with asyncio.TaskGroup() as group:
                group.create_task(self.dispatcher.run(), name="mtask-dispatch")
                group.create_task(Sweep(self.dispatcher.host).run(), name="mtask-host-sweep")
                group.create_task(self._keep_lease(driver), name="mtask-relay-lease")
                group.create_task(self._read_reports(), name="mtask-relay-reports")
                await follow(
                    self.database,
                    self._pipeline,
                    opened=self._opened,
                    changed=self._changed,
                    restarted=restarted,
                )
        except* LeaseLost as lost:
            log.warning("the relay stops: %s", lost.exceptions[0])
        finally:
            if Relay.local.get(self.id) is self:
                del Relay.local[self.id]
            for subscriber in list(self.subscribers):
                subscriber.close()
            self.subscribers.clear()
            self.by_subscription.clear()
            with contextlib.suppress(StorageError, asyncio.CancelledError):  # else it runs out
                await asyncio.shield(driver.run(relays.release(self.tasks, self.id)))

    async def _keep_lease(self, driver: Any) -> None:
        renewed = time.monotonic()
        swept = renewed
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
            self._let_go_of_the_silent()
            if renewed - swept >= INBOX_SWEEP:
                swept = renewed
                await self._drop_stale_inboxes()

    async def _drop_stale_inboxes(self) -> None:
        keep = {inbox.writer.collection.name for inbox in self.by_subscription.values()}
        before = self.dispatcher.now() - dt.timedelta(seconds=INBOX_SWEEP)
        try:
            for name in await mailbox.stale_inboxes(self.database, self.tasks, keep, before):
                await self._drop_inbox(name)
        except PyMongoError as exc:
            log.debug("cannot sweep stale inboxes: %s", exc)

    # -- subscribers ------------------------------------------------------------------------

    def attach(self, worker_id: str, names: list[str], free: int) -> Local:
        """Subscribe a worker of this process and event loop."""
        local = Local(self)
        self._add(local, worker_id, names, free)
        return local

    def _add(self, subscriber: Subscriber, worker_id: str, names: list[str], free: int) -> None:
        self.subscribers[subscriber] = worker_id
        self.dispatcher.add(subscriber, worker_id, names, free)
        self._note_change()
        if self.open and self.direct is None:
            subscriber.send(OPEN)

    def remove(self, subscriber: Subscriber) -> None:
        if self.subscribers.pop(subscriber, None) is not None:
            self.dispatcher.remove(subscriber)
            self._note_change()
        if isinstance(subscriber, _Inbox):
            self.by_subscription.pop(subscriber.subscription, None)
            if self.loop is not None and not subscriber.closing():
                name = subscriber.writer.collection.name
                self.loop.create_task(self._drop_inbox(name), name="mtask-drop-inbox")
        subscriber.close()

    async def _drop_inbox(self, name: str) -> None:
        """The relay alone writes an inbox, so it drops it too, once it wrote its last frame
        (an insert into a dropped collection would make it again)."""
        try:
            await self.database.drop_collection(name)
        except PyMongoError as exc:
            log.debug("cannot drop inbox %s: %s", name, exc)

    def lost(self, subscriber: _Inbox, exc: Exception) -> None:
        """A frame could not be written to the subscriber's inbox."""
        log.info("cannot write to a subscriber's inbox (%s); letting it go", exc)
        self.remove(subscriber)

    def _let_go_of_the_silent(self) -> None:
        now = time.monotonic()
        for subscription, inbox in list(self.by_subscription.items()):
            if now - inbox.heard > 3 * KEEPALIVE:
                log.info(
                    "subscription %s said nothing for %gs: letting it go",
                    subscription,
                    3 * KEEPALIVE,
                )
                self.remove(inbox)

    def _alone(self) -> Local | None:
        """The relay's own worker, if it is the only subscriber."""
        if len(self.subscribers) != 1:
            return None
        [(subscriber, worker_id)] = self.subscribers.items()
        return subscriber if isinstance(subscriber, Local) and worker_id == self.owner else None

    def _set_direct(self) -> None:
        """Hand out or pass events on, as the subscribers are now."""
        alone = self._alone()
        if alone is self.direct:
            return
        was, self.direct = self.direct, alone
        if not self.open:
            return
        if alone is not None:  # alone again: the relay's work is its own worker's
            self.dispatcher.clear()
            alone.send(OWN)
        elif was is not None:  # no longer alone: the relay's queue scans and hands out
            self.dispatcher.host.active = True
            self.dispatcher.host.request_rescan()
            self.broadcast(OPEN)

    def drop(self, subscriber: Subscriber) -> None:
        """A subscriber past its buffer: it goes (it says hello again)."""
        worker_id = self.subscribers.get(subscriber)
        if worker_id is not None and not subscriber.closing():
            self.dropped += 1
            log.warning("dropped a slow subscriber of the shared change stream: %s", worker_id)
        self.remove(subscriber)

    def report(self, subscriber: Subscriber, message: Mapping[str, Any]) -> None:
        """What a subscriber said: its credit, its names, what it claimed, holds, finished,
        could not claim, found gone."""
        dispatcher = self.dispatcher
        for key, claim_at in message.get("claimed") or ():
            dispatcher.claimed(key, claim_at, subscriber)
        for key in message.get("held") or ():
            dispatcher.held(key)
        for key in message.get("done") or ():
            dispatcher.succeeded(key, subscriber)
        for key in message.get("missed") or ():
            dispatcher.missed(key, subscriber)
        for key in message.get("gone") or ():
            dispatcher.gone(key)
        if "free" in message:
            dispatcher.report(
                subscriber, int(message["free"]), int(message.get("got", 0)), message.get("names")
            )

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
        inbox = self.by_subscription.get(subscription)
        if message.get("hello") is not None:
            self._hello(subscription, message, inbox)
        elif inbox is None:
            return  # an earlier subscription, let go: it hears nothing and says hello again
        elif message.get("bye"):
            self.remove(inbox)
        else:
            inbox.heard = time.monotonic()
            try:
                self.report(inbox, message)
            except (TypeError, ValueError) as exc:
                log.warning("a subscriber's report makes no sense (%s); letting it go", exc)
                self.remove(inbox)

    def _hello(self, subscription: str, hello: Mapping[str, Any], was: _Inbox | None) -> None:
        worker_id, inbox_name = hello.get("worker_id"), hello.get("inbox")
        if hello.get("hello") != PROTOCOL or not isinstance(worker_id, str):
            log.warning("refused a subscriber that is not mtask %s's: %r", PROTOCOL, worker_id)
            return
        if not isinstance(inbox_name, str) or not mailbox.is_inbox(self.tasks, inbox_name):
            log.warning("refused a subscriber without an inbox: %s", worker_id)
            return
        if was is not None:
            self.remove(was)
        names = [n for n in hello.get("names") or () if isinstance(n, str)]
        free = hello.get("free")
        inbox = _Inbox(self, self.database[inbox_name], subscription)
        self.by_subscription[subscription] = inbox
        self._add(inbox, worker_id, names, free if isinstance(free, int) else 0)

    def _note_change(self) -> None:
        if self.excluded != tuple(sorted(self.subscribers.values())):
            self._switch = True
        self._set_direct()

    # -- the stream ---------------------------------------------------------------------------

    def _pipeline(self) -> list[dict[str, Any]]:
        self.excluded = tuple(sorted(self.subscribers.values()))
        return stream_pipeline(self.tasks, self.excluded)

    async def _opened(self) -> None:
        self.direct = self._alone()
        if self.direct is not None:
            self.dispatcher.clear()
            self.open = True
            self.direct.send(OWN)  # its worker scans, as after an own stream's (re)open
            return
        self.dispatcher.host.active = True
        await self.dispatcher.host.opened()  # the relay's queue scans: nothing slips between
        self.open = True
        self.broadcast(OPEN)

    async def _changed(self, change: Mapping[str, Any] | None) -> None:
        host = self.dispatcher.host
        if change is not None:
            if change.get("ns", {}).get("coll") in OTHER_COLLECTIONS:
                self.broadcast(change)
            elif self.direct is not None:
                self.direct.send(change)
            else:
                self.dispatcher.on_event(change.get("documentKey", {}).get("_id"))
                host.on_change(change)
            self._unyielded += 1
            if self._unyielded >= YIELD_EVERY:  # a large batch: let the dispatcher hand out
                self._unyielded = 0
                await asyncio.sleep(0)
        if self.direct is None:
            await host.settle()
        if self._switch:  # a subscriber came or went: its tags in the filter, from here on
            self._switch = False
            raise Reopen

    def broadcast(self, doc: Mapping[str, Any]) -> None:
        """Queue ``doc`` for every subscriber."""
        for subscriber in list(self.subscribers):
            if subscriber.closing():
                self.drop(subscriber)
            else:
                subscriber.send(doc)


__all__ = ["LEASE_TTL", "SUBSCRIBER_BUFFER", "LeaseLost", "Local", "Relay"]
