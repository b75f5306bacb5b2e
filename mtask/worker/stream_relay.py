"""One change stream and one claim queue per host, shared by the worker processes on it
(``--stream shared``): the relay.

Every worker used to hold a change stream of its own, and mongod built and sent every event
once per worker; and every worker queued every task, so several raced for each one: mongod's
CPU and the claim attempts per task grew with the number of workers (bench W9). Here the first
worker process on a host to bind the endpoint (an abstract Unix socket named after the tasks
collection's UUID, so that it vanishes with its process and leaves no stale file) becomes the
host's *relay*: it holds the one change stream, the host's claim queue and its dispatcher
(``dispatch.py``), and hands each due task to one subscribed worker with a free slot, itself
included. The subscriber claims it as before (``shared_stream.py``).

- Events are hints, the claim decides, the sweep bounds a lost wake-up. The host queue rescans
  each time the relay's stream (re)opens and every sweep; a subscriber that (re)connects gets
  ``{"relay": "open"}`` and from then on its tasks from the relay.
- The relay's stream leaves out its subscribers' claims and successes (their ``last_write``
  tags, as an own stream leaves out its worker's): they tell the relay instead. When a
  subscriber comes or goes the stream is reopened with the new tags, resuming after its last
  event (no gap, no rescan).
- The change events of ``controls``, ``limits`` and ``schedules`` go to every subscriber.
- While the relay's own worker is its only subscriber (one worker process on the host: the
  common case), nothing is handed out: the relay passes that worker its task events as an own
  stream would (``{"relay": "own"}``), at an own stream's cost. When another subscriber comes,
  the host queue scans and the relay hands out again; when it is alone again, its worker
  scans for itself.
- A slow subscriber never blocks the relay: writes are buffered per subscriber up to
  ``SUBSCRIBER_BUFFER`` bytes; past that the subscriber is dropped and reconnects.
- If the relay dies (kill -9 included: the kernel closes its sockets), its subscribers see the
  end of their connection and race to bind; the kernel lets exactly one win, the others
  connect to it. Keys it had handed over are claimed, or come back with the sweep.
- Peers are checked (``SO_PEERCRED``): only processes of the same user are served.
"""

from __future__ import annotations

import asyncio
import collections
import errno
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

from bson.errors import BSONError

from mtask.worker.dispatch import Dispatcher
from mtask.worker.relay_wire import OPEN, OWN, PROTOCOL, TICK, decode, frame, peer, read_frame
from mtask.worker.stream import Reopen, follow, stream_pipeline
from mtask.worker.watcher import Sweep

log = logging.getLogger(__name__)

SUBSCRIBER_BUFFER = 4 * 1024 * 1024
"""Bytes the relay buffers for one subscriber before it drops it."""
YIELD_EVERY = 64
"""Events the relay takes before it lets the event loop turn (subscribers read meanwhile)."""
OTHER_COLLECTIONS = ("controls", "limits", "schedules")
TICK_FRAME = frame(TICK)


class _Socket:
    """A subscriber in another process (or another event loop): frames on its connection,
    gathered and written once per turn of the event loop."""

    def __init__(self, writer: asyncio.StreamWriter, relay: Relay | None = None) -> None:
        self.writer = writer
        self.relay = relay
        self.pending: list[bytes] = []
        self.pending_bytes = 0

    def backlog(self) -> int:
        return self.writer.transport.get_write_buffer_size() + self.pending_bytes

    def closing(self) -> bool:
        return self.writer.transport.is_closing()

    def send(self, doc: Mapping[str, Any], data: bytes | None = None) -> None:
        data = frame(doc) if data is None else data
        if self.relay is not None and self.backlog() + len(data) > self.relay.buffer:
            self.relay.drop(self)
            return
        self.pending.append(data)
        self.pending_bytes += len(data)
        if self.relay is not None:
            self.relay.flush_soon()

    def dispatch(self, entries: list[list[Any]]) -> None:
        self.send({"d": entries})

    def tick(self) -> None:
        self.send(TICK, TICK_FRAME)

    def flush(self) -> None:
        if self.pending and not self.closing():
            self.writer.write(b"".join(self.pending))
        self.pending.clear()
        self.pending_bytes = 0

    def close(self) -> None:
        self.writer.transport.abort()


class Local:
    """A subscriber in the relay's own process and event loop: frames handed over as the
    documents they are (no socket, no BSON), bounded like a connection's buffer."""

    EVENT_BYTES = 256
    """What a frame counts for against the buffer."""

    def __init__(self, relay: Relay | None = None) -> None:
        self.relay = relay
        self.items: collections.deque[Mapping[str, Any]] = collections.deque()
        self.ready = asyncio.Event()
        self.closed = False

    def backlog(self) -> int:
        return len(self.items) * self.EVENT_BYTES

    def closing(self) -> bool:
        return self.closed

    def send(self, doc: Mapping[str, Any], data: bytes | None = None) -> None:
        if self.relay is not None and self.backlog() + self.EVENT_BYTES > self.relay.buffer:
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


Subscriber = _Socket | Local

_LOCAL: dict[str, Relay] = {}
"""The relays held in this process, by endpoint: a worker on the same event loop subscribes
to its relay directly (``Local``)."""


class Relay:
    """The host's change stream and claim queue, for the subscribers of ``server``."""

    def __init__(
        self, database: Any, tasks: str, owner: str, buffer: int, dispatcher: Dispatcher
    ) -> None:
        self.database = database
        self.tasks = tasks
        self.owner = owner
        """The worker id of the worker whose process holds the relay."""
        self.buffer = buffer
        self.dispatcher = dispatcher
        self.subscribers: dict[Subscriber, str] = {}
        self.server: asyncio.AbstractServer | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.name = ""
        self.open = False
        self.excluded: tuple[str, ...] = ()
        """The workers whose claims and successes the stream in use leaves out."""
        self.direct: Local | None = None
        """The relay's own worker, while it is the only subscriber: it gets the task events."""
        self._switch = False
        self._flush_soon: asyncio.Handle | None = None
        self._unyielded = 0
        self.dropped = 0
        self.switches = 0

    @classmethod
    async def bind(
        cls, name: str, database: Any, tasks: str, owner: str, buffer: int, dispatcher: Dispatcher
    ) -> Relay | None:
        """The relay, if this process won the endpoint; ``None`` if another holds it."""
        relay = cls(database, tasks, owner, buffer, dispatcher)
        try:
            relay.server = await asyncio.start_unix_server(relay._serve, path=name)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return None
            raise
        relay.loop, relay.name = asyncio.get_running_loop(), name
        _LOCAL[name] = relay
        return relay

    async def run(self, restarted: Callable[[], None] = lambda: None) -> None:
        """Follow the stream, hand out tasks and sweep until cancelled; then close the
        endpoint and every connection. If one of them fails, so does the relay."""
        try:
            async with asyncio.TaskGroup() as group:
                group.create_task(self.dispatcher.run(), name="mtask-dispatch")
                group.create_task(Sweep(self.dispatcher.host).run(), name="mtask-host-sweep")
                await follow(
                    self.database,
                    self._pipeline,
                    opened=self._opened,
                    changed=self._changed,
                    restarted=restarted,
                )
        finally:
            if self._flush_soon is not None:
                self._flush_soon.cancel()
            if _LOCAL.get(self.name) is self:
                del _LOCAL[self.name]
            if self.server is not None:
                self.server.close()
            for subscriber in list(self.subscribers):
                subscriber.close()
            self.subscribers.clear()

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
        subscriber.close()

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
        if alone is not None:  # alone again: the host queue's work is its own worker's
            self.dispatcher.clear()
            alone.send(OWN)
        elif was is not None:  # no longer alone: the host queue scans and hands out
            self.dispatcher.host.active = True
            self.dispatcher.host.request_rescan()
            self.broadcast(OPEN)

    def drop(self, subscriber: Subscriber) -> None:
        """A subscriber past its buffer: it goes (it reconnects)."""
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
        await self.dispatcher.host.opened()  # the host queue scans: nothing slips between
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
            self.switches += 1
            raise Reopen

    def broadcast(self, doc: Mapping[str, Any]) -> None:
        """Queue ``doc`` for every subscriber (encoded once for all connections)."""
        data = frame(doc) if any(isinstance(s, _Socket) for s in self.subscribers) else b""
        for subscriber in list(self.subscribers):
            if subscriber.closing():
                self.drop(subscriber)
            else:
                subscriber.send(doc, data)

    def flush_soon(self) -> None:
        if self._flush_soon is None and self.loop is not None:
            self._flush_soon = self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_soon = None
        for subscriber in self.subscribers:
            if isinstance(subscriber, _Socket):
                subscriber.flush()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One subscriber: its hello, then its reports until it goes."""
        try:
            if peer(writer)[1] != os.getuid():
                raise ConnectionError("a process of another user")
            hello = decode(await asyncio.wait_for(_frame_or_fail(reader), 10))
            worker_id = hello.get("worker_id")
            if hello.get("hello") != PROTOCOL or not isinstance(worker_id, str):
                raise ConnectionError(f"not an mtask {PROTOCOL} subscriber")
            names = [n for n in hello.get("names") or () if isinstance(n, str)]
            free = int(hello.get("free") or 0)
        except (ConnectionError, OSError, TimeoutError, BSONError, TypeError, ValueError) as exc:
            log.debug("refused a subscriber: %s", exc)
            writer.transport.abort()
            return
        subscriber = _Socket(writer, self)
        self._add(subscriber, worker_id, names, free)
        try:
            while (data := await read_frame(reader)) is not None:
                self.report(subscriber, decode(data))
        except (ConnectionError, OSError, BSONError, TypeError, ValueError) as exc:
            log.debug("a subscriber's connection ended: %s", exc)
        finally:
            self.remove(subscriber)


async def _frame_or_fail(reader: asyncio.StreamReader) -> bytes:
    data = await read_frame(reader)
    if data is None:
        raise ConnectionError("closed before its hello")
    return data


__all__ = ["SUBSCRIBER_BUFFER", "Local", "Relay"]
