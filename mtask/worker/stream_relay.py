"""One change stream per host, shared by the worker processes on it (``--stream shared``).

Every worker used to hold a change stream of its own, and mongod built and sent every event
once per worker: its CPU per task grew with the number of workers (bench W9). Here the first
worker process on a host to bind the endpoint (an abstract Unix socket named after the tasks
collection's UUID, so that it vanishes with its process and leaves no stale file) becomes the
host's *relay*: it holds the one change stream and forwards each event, as the BSON document
it is (BSON is length-prefixed), to every subscribed worker on the host, itself included.

- Events are hints, the claim decides, the sweep bounds a lost wake-up. A subscriber rescans
  each time the relay says its stream is (re)open (``{"relay": "open"}``, also the first frame
  a subscriber gets), so one that (re)connects misses nothing, as an own stream's reopen.
- The relay's stream leaves out nobody's writes at the server (``stream_pipeline(tasks,
  None)``) and keeps the last-write tag: each subscriber drops its own claims and successes
  (``stream.own_write``), as its own stream's ``$match`` would have. While the relay's worker
  is its only subscriber, it uses the own pipeline (the server leaves out its writes, as
  before) and switches, resuming after the last event, when another subscriber comes or goes.
- A slow subscriber never blocks the relay: writes are buffered per subscriber up to
  ``SUBSCRIBER_BUFFER`` bytes; past that the subscriber is dropped, reconnects and rescans.
- If the relay dies (kill -9 included: the kernel closes its sockets), its subscribers see the
  end of their connection and race to bind; the kernel lets exactly one win, the others
  connect to it. The relay's resume-token handling is the own stream's (``stream.follow``).
- Peers are checked (``SO_PEERCRED``): only processes of the same user are served or trusted.
  Where the endpoint cannot be used (not Linux, another user's relay, an unexpected socket
  error) the worker falls back to its own stream.
"""

from __future__ import annotations

import asyncio
import collections
import errno
import hashlib
import logging
import os
import random
import socket
import struct
import sys
from collections.abc import Awaitable, Callable, Mapping
from typing import Any
from uuid import UUID

import bson
from bson.errors import BSONError
from pymongo.errors import PyMongoError

from mtask import store
from mtask.connection import CODEC_OPTIONS
from mtask.errors import StorageError
from mtask.worker.stream import OwnStream, Reopen, follow, own_write, stream_pipeline
from mtask.worker.watcher import Watcher

log = logging.getLogger(__name__)

PROTOCOL = 1
SUBSCRIBER_BUFFER = 4 * 1024 * 1024
"""Bytes the relay buffers for one subscriber before it drops it (about 16,000 events)."""
MAX_FRAME = 16 * 1024 * 1024 + 16 * 1024
YIELD_EVERY = 64
"""Events the relay forwards before it lets the event loop turn: the frames of up to this many
events go to a connection in one write, and subscribers in this process read meanwhile."""
OPEN = {"relay": "open"}


def endpoint(database: str, collection: str, uuid: Any) -> str:
    """The abstract socket name of the relay for one tasks collection (``uuid``: its UUID)."""
    if isinstance(uuid, UUID):
        uuid = uuid.bytes
    if isinstance(uuid, bytes):  # a bson Binary too, whatever the client's uuidRepresentation
        uuid = uuid.hex()
    identity = f"{database}\x00{collection}\x00{uuid}".encode()
    return f"\x00mtask-stream-{PROTOCOL}-{hashlib.blake2b(identity, digest_size=12).hexdigest()}"


def frame(doc: Mapping[str, Any]) -> bytes:
    """One frame: the BSON document (its first four bytes are its length)."""
    return bson.encode(doc)


async def read_frame(reader: asyncio.StreamReader) -> bytes | None:
    """The next frame, or ``None`` at the end of the stream; ``ConnectionError`` if cut or bad."""
    try:
        head = await reader.readexactly(4)
    except asyncio.IncompleteReadError as exc:
        if exc.partial:
            raise ConnectionError("connection cut inside a frame") from exc
        return None
    size = int.from_bytes(head, "little")
    if not 5 <= size <= MAX_FRAME:
        raise ConnectionError(f"bad frame length {size}")
    try:
        return head + await reader.readexactly(size - 4)
    except asyncio.IncompleteReadError as exc:
        raise ConnectionError("connection cut inside a frame") from exc


def decode(data: bytes) -> dict[str, Any]:
    return bson.decode(data, codec_options=CODEC_OPTIONS)


def peer(writer: asyncio.StreamWriter) -> tuple[int, int]:
    """The (pid, uid) of the process at the other end of a Unix socket."""
    sock = writer.get_extra_info("socket")
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _ = struct.unpack("3i", creds)
    return pid, uid


class _Socket:
    """A subscriber in another process (or another event loop): frames on its connection,
    gathered and written once per turn of the event loop (one write for a getMore's batch)."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.pending: list[bytes] = []
        self.pending_bytes = 0

    def backlog(self) -> int:
        return self.writer.transport.get_write_buffer_size() + self.pending_bytes

    def closing(self) -> bool:
        return self.writer.transport.is_closing()

    def send(self, doc: Mapping[str, Any], data: bytes) -> None:
        self.pending.append(data)
        self.pending_bytes += len(data)

    def flush(self) -> None:
        if self.pending and not self.closing():
            self.writer.write(b"".join(self.pending))
        self.pending.clear()
        self.pending_bytes = 0

    def close(self) -> None:
        self.writer.transport.abort()


class Local:
    """A subscriber in the relay's own process and event loop: documents handed over as
    they are (no socket, no BSON), bounded like a connection's buffer."""

    EVENT_BYTES = 256
    """What an event counts for against the buffer (about a projected insert's size)."""

    def __init__(self) -> None:
        self.items: collections.deque[Mapping[str, Any]] = collections.deque()
        self.ready = asyncio.Event()
        self.closed = False

    def backlog(self) -> int:
        return len(self.items) * self.EVENT_BYTES

    def closing(self) -> bool:
        return self.closed

    def send(self, doc: Mapping[str, Any], data: bytes) -> None:
        self.items.append(doc)
        self.ready.set()

    def close(self) -> None:
        self.closed = True
        self.ready.set()

    async def next(self) -> Mapping[str, Any] | None:
        """The next event, or ``None`` once closed (the relay went, or dropped it)."""
        while not self.items and not self.closed:
            self.ready.clear()
            await self.ready.wait()
        return None if self.closed else self.items.popleft()


Subscriber = _Socket | Local

_LOCAL: dict[str, Relay] = {}
"""The relays held in this process, by endpoint: a worker on the same event loop subscribes
to its relay directly (``Local``)."""


class Relay:
    """The host's change stream, forwarded to the subscribers connected to ``server``."""

    def __init__(self, database: Any, tasks: str, owner: str, buffer: int) -> None:
        self.database = database
        self.tasks = tasks
        self.owner = owner
        """The worker id of the worker whose process holds the relay."""
        self.buffer = buffer
        self.subscribers: dict[Subscriber, str] = {}
        self.server: asyncio.AbstractServer | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.name = ""
        self.open = False
        self.solo = False
        """The stream in use leaves out the owner's writes (it is the only subscriber)."""
        self._switch = False
        self._flush_soon: asyncio.Handle | None = None
        self._unyielded = 0
        self.dropped = 0
        self.switches = 0

    @classmethod
    async def bind(
        cls, name: str, database: Any, tasks: str, owner: str, buffer: int
    ) -> Relay | None:
        """The relay, if this process won the endpoint; ``None`` if another holds it."""
        relay = cls(database, tasks, owner, buffer)
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
        """Follow the stream until cancelled; then close the endpoint and every connection."""
        try:
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

    def attach(self, worker_id: str) -> Local:
        """Subscribe a worker of this process and event loop."""
        local = Local()
        self._add(local, worker_id)
        return local

    def _add(self, subscriber: Subscriber, worker_id: str) -> None:
        self.subscribers[subscriber] = worker_id
        self._note_change()
        if self.open:
            subscriber.send(OPEN, frame(OPEN))

    def remove(self, subscriber: Subscriber) -> None:
        if self.subscribers.pop(subscriber, None) is not None:
            self._note_change()
        subscriber.close()

    def _alone(self) -> bool:
        return all(worker_id == self.owner for worker_id in self.subscribers.values())

    def _pipeline(self) -> list[dict[str, Any]]:
        self.solo = self._alone()
        return stream_pipeline(self.tasks, self.owner if self.solo else None)

    async def _opened(self) -> None:
        self.open = True
        self.broadcast(OPEN)

    async def _changed(self, change: Mapping[str, Any] | None) -> None:
        if change is not None:
            self.broadcast(change)
            self._unyielded += 1
            if self._unyielded >= YIELD_EVERY:  # a large batch: let the readers keep up
                self._unyielded = 0
                await asyncio.sleep(0)
        if self._switch:  # a subscriber came or went: the other pipeline, from here on
            self._switch = False
            self.switches += 1
            raise Reopen

    def broadcast(self, doc: Mapping[str, Any]) -> None:
        """Queue ``doc`` for every subscriber; drop those whose buffer would overflow."""
        data = b""
        if any(isinstance(s, _Socket) for s in self.subscribers):
            data = frame(doc)  # once for all connections
        for subscriber in list(self.subscribers):
            size = len(data) if isinstance(subscriber, _Socket) else Local.EVENT_BYTES
            if subscriber.closing() or subscriber.backlog() + size > self.buffer:
                self._drop(subscriber)
            else:
                subscriber.send(doc, data)
        if data and self._flush_soon is None:
            self._flush_soon = asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_soon = None
        for subscriber in self.subscribers:
            if isinstance(subscriber, _Socket):
                subscriber.flush()

    def _drop(self, subscriber: Subscriber) -> None:
        worker_id = self.subscribers.get(subscriber)
        if worker_id is not None and not subscriber.closing():
            self.dropped += 1
            log.warning("dropped a slow subscriber of the shared change stream: %s", worker_id)
        self.remove(subscriber)

    def _note_change(self) -> None:
        if self.solo != self._alone():
            self._switch = True

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One subscriber: its hello, then nothing until it goes."""
        try:
            if peer(writer)[1] != os.getuid():
                raise ConnectionError("a process of another user")
            hello = decode(await asyncio.wait_for(_frame_or_fail(reader), 10))
            worker_id = hello.get("worker_id")
            if hello.get("hello") != PROTOCOL or not isinstance(worker_id, str):
                raise ConnectionError(f"not an mtask {PROTOCOL} subscriber")
        except (ConnectionError, OSError, TimeoutError, BSONError) as exc:
            log.debug("refused a subscriber: %s", exc)
            writer.transport.abort()
            return
        subscriber = _Socket(writer)
        self._add(subscriber, worker_id)
        try:
            while await reader.read(4096):
                pass  # a subscriber sends nothing after its hello
        except (ConnectionError, OSError):
            pass
        finally:
            self.remove(subscriber)


async def _frame_or_fail(reader: asyncio.StreamReader) -> bytes:
    data = await read_frame(reader)
    if data is None:
        raise ConnectionError("closed before its hello")
    return data


class SharedStream:
    """A watcher's change source when it shares the host's stream: relay or subscriber."""

    def __init__(self, buffer: int | None = None) -> None:
        self.buffer = buffer
        self.relay: Relay | None = None
        self._relay_task: asyncio.Task[None] | None = None
        self._failure: BaseException | None = None
        self.endpoint: str | None = None
        self.connections = 0
        self.fallback = False

    async def run(self, watcher: Watcher) -> None:
        if not sys.platform.startswith("linux"):  # abstract sockets are Linux's
            await self._fall_back(watcher, "abstract Unix sockets need Linux")
        name = self.endpoint = await self._endpoint(watcher)
        try:
            while True:
                try:
                    await self._ensure_relay(name, watcher)
                    relay = _LOCAL.get(name)
                    if relay is not None and relay.loop is asyncio.get_running_loop():
                        await self._consume_local(relay, watcher)
                        continue
                    reader, writer = await asyncio.open_unix_connection(name)
                except (ConnectionRefusedError, FileNotFoundError):
                    await asyncio.sleep(random.uniform(0.01, 0.1))  # going or coming: bind
                    continue
                except OSError as exc:
                    await self._fall_back(watcher, str(exc))
                try:
                    if peer(writer)[1] != os.getuid():
                        await self._fall_back(watcher, "the endpoint is another user's")
                    self.connections += 1
                    writer.write(frame({"hello": PROTOCOL, "worker_id": watcher.worker_id}))

                    async def next_change(
                        reader: asyncio.StreamReader = reader,
                    ) -> Mapping[str, Any] | None:
                        data = await read_frame(reader)
                        return None if data is None else decode(data)

                    await self._consume(next_change, writer.transport.abort, watcher)
                except (ConnectionError, OSError) as exc:
                    log.info("shared change stream connection lost (%s); reconnecting", exc)
                finally:
                    writer.transport.abort()
                if self._failure is not None:
                    raise self._failure
                await asyncio.sleep(random.uniform(0.01, 0.1))
        finally:
            if self._relay_task is not None:
                self._relay_task.cancel()
                await asyncio.gather(self._relay_task, return_exceptions=True)

    async def _consume_local(self, relay: Relay, watcher: Watcher) -> None:
        """Subscribe to the relay of this event loop directly; until it goes or drops us."""
        local = relay.attach(watcher.worker_id)
        self.connections += 1
        try:
            await self._consume(local.next, local.close, watcher)
        finally:
            relay.remove(local)
        if self._failure is not None:
            raise self._failure
        await asyncio.sleep(random.uniform(0.01, 0.1))

    async def _fall_back(self, watcher: Watcher, why: str) -> None:
        log.warning("cannot share the host's change stream (%s); using an own one", why)
        self.fallback = True
        await OwnStream().run(watcher)
        raise AssertionError("unreachable: a stream is followed until cancelled")

    async def _endpoint(self, watcher: Watcher) -> str:
        tasks = watcher.driver.collections["tasks"]
        backoff = 0.1
        while True:
            try:
                uuid = await watcher.driver.run(store.collection_uuid(tasks.name))
                return endpoint(tasks.database.name, tasks.name, uuid)
            except (StorageError, PyMongoError) as exc:
                log.warning("cannot read the tasks collection's UUID yet: %s", exc)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 5.0)

    async def _ensure_relay(self, name: str, watcher: Watcher) -> None:
        task = self._relay_task
        if task is not None and task.done() and not task.cancelled():
            task.result()  # a relay that died of anything but cancellation is a bug: raise it
        if task is not None and not task.done():
            return
        tasks = watcher.driver.collections["tasks"]
        buffer = SUBSCRIBER_BUFFER if self.buffer is None else self.buffer
        relay = await Relay.bind(name, tasks.database, tasks.name, watcher.worker_id, buffer)
        if relay is not None:
            log.info("this worker holds the host's shared change stream")

            def restarted() -> None:
                watcher.stream_restarts += 1

            self.relay = relay
            self._relay_task = asyncio.create_task(relay.run(restarted), name="mtask-relay")

    async def _consume(
        self,
        next_change: Callable[[], Awaitable[Mapping[str, Any] | None]],
        close: Callable[[], None],
        watcher: Watcher,
    ) -> None:
        rescans: list[asyncio.Task[None]] = []
        try:
            while (change := await next_change()) is not None:
                if change.get("relay") == "open":
                    # concurrently: an event applied meanwhile wins over the scan (``_touched``)
                    rescans = [t for t in rescans if not t.done()]
                    rescans.append(asyncio.create_task(self._opened(watcher, close)))
                    continue
                if own_write(change, watcher.worker_id):
                    continue
                watcher.on_change(change)
                # let a woken worker loop send its claim before the next event (W2 latency)
                await asyncio.sleep(0)
                try:
                    await watcher.settle()
                except (StorageError, PyMongoError) as exc:  # the sweep brings them back
                    log.warning("cannot look up tasks from the shared stream: %s", exc)
                    watcher.request_rescan()
        finally:
            for task in rescans:
                task.cancel()
            await asyncio.gather(*rescans, return_exceptions=True)

    async def _opened(self, watcher: Watcher, close: Callable[[], None]) -> None:
        backoff = 0.1
        while True:
            try:
                await watcher.opened()
                return
            except (StorageError, PyMongoError) as exc:
                log.warning("rescan after the shared stream opened failed, retrying: %s", exc)
            except Exception as exc:  # noqa: BLE001 (a bug: stop the worker, as an own stream's would)
                self._failure = exc
                close()
                return
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 5.0)


__all__ = ["Relay", "SharedStream", "endpoint", "frame", "read_frame"]
