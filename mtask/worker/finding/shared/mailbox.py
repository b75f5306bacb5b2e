"""The wire between the relay and its subscribers, through MongoDB alone: they may be on any
host, and nothing but MongoDB is shared.

- **A subscriber's inbox**: a capped collection made for one subscription
  (``inbox_name``), which only the relay writes and only that subscriber tails. A tailable
  cursor wakes for inserts into its own collection only, so a frame costs the server the same
  whatever the number of subscribers. (A change stream per worker, or one collection that every
  worker tails with a filter, wakes every reader on every write: the server's CPU per task grew
  with the hosts. ``docs/finding-work.md`` has the measurements.)
- **The relay's inbox** (``reports_name``): one capped collection per tasks collection, which
  every subscriber writes and only the relay tails, each frame addressed to one relay (``to``)
  and signed by its subscription (``from``).
- A frame is a document: ``{"f": frame}`` in an inbox, ``{"to", "from", "f"}`` in the relay's.
  What the frames say is in ``wire``.
- Both live in the inbox database (``driver.inbox_database``: ``<database>_inbox``), never in
  mtask's: the privileges to make, write and drop collections named at run time are granted
  there only (``security.roles``), and the ``database`` every function here takes is that one.

Every inbox starts with a marker document: a tailable cursor that finds nothing when it opens
is closed by the server at once.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import logging
import re
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from typing import Any

from pymongo import CursorType, WriteConcern
from pymongo.errors import CollectionInvalid, OperationFailure, PyMongoError

log = logging.getLogger(__name__)

INBOX_BYTES = 1024 * 1024
"""A subscriber's inbox: frames the subscriber has not read yet, at most (it is dropped past
its buffer first: ``relay.SUBSCRIBER_BUFFER`` counts what is in flight)."""
REPORTS_BYTES = 16 * 1024 * 1024
"""The relay's inbox, shared by every subscriber of every relay of one tasks collection."""
AWAIT_MS = 60_000
"""How long one getMore of a tailing cursor waits for a frame (one arrives at once: this is
only the idle cost, a getMore a minute; at 10 s, 64 idle hosts' inboxes were 6.4 of the
server's 47 operations a second)."""
DRAIN = 2.0
"""Seconds a closing writer waits for its last frames to be written."""
MARKER: Mapping[str, Any] = {"marker": True}
NAMESPACE_EXISTS = 48
HINT = WriteConcern(w=1)


def inbox_name(tasks: str, subscription: str) -> str:
    digest = hashlib.blake2b(subscription.encode(), digest_size=12).hexdigest()
    return f"{tasks}.inbox.{digest}"


def reports_name(tasks: str) -> str:
    return f"{tasks}.reports"


def is_inbox(tasks: str, name: str) -> bool:
    return name.startswith(f"{tasks}.inbox.")


async def inboxes(database: Any, tasks: str) -> list[dict[str, Any]]:
    """Every inbox of ``tasks`` (its ``listCollections`` entry)."""
    found = await database.list_collections(
        filter={"name": {"$regex": f"^{re.escape(tasks)}\\.inbox\\."}}
    )
    return [info async for info in found]


async def stale_inboxes(database: Any, tasks: str, keep: set[str], before: Any) -> list[str]:
    """Inboxes of ``tasks`` not in ``keep`` that nobody will read: not capped (made again by
    a late write into a dropped one), or made before ``before`` (their subscriber is gone:
    one that lives subscribes again, with a new inbox, within ``SILENT`` seconds)."""
    stale = []
    for info in await inboxes(database, tasks):
        name = info["name"]
        if name in keep:
            continue
        if not info.get("options", {}).get("capped"):
            stale.append(name)
            continue
        marker = await database[name].find_one({"marker": True})
        made = marker.get("at") if marker else None
        if made is None or made < before:
            stale.append(name)
    return stale


async def drop_stale(
    database: Any, tasks: str, keep: set[str], before: Any, last: Mapping[str, Any] | None = None
) -> None:
    """Drop the inboxes of ``tasks`` made before ``before`` that are not in ``keep`` (their
    subscribers went without a goodbye, or the relay lost track of them), each after
    ``last``."""
    try:
        for name in await stale_inboxes(database, tasks, keep, before):
            await drop(database, name, last)
    except PyMongoError as exc:
        log.debug("cannot sweep stale inboxes: %s", exc)


async def tell_others(
    database: Any, tasks: str, served: Callable[[], set[str]], frame: Mapping[str, Any]
) -> None:
    """Insert ``frame`` into every inbox of ``tasks`` not ``served()`` (asked as each is
    written: one that said hello meanwhile is left alone), all at once."""
    try:
        names = [info["name"] for info in await inboxes(database, tasks)]
    except PyMongoError as exc:
        log.info("cannot list the inboxes (%s): their subscribers look at the lease", exc)
        return

    async def tell(name: str) -> None:
        if name not in served():
            with contextlib.suppress(PyMongoError):  # gone meanwhile
                await database[name].with_options(write_concern=HINT).insert_one(dict(frame))

    await asyncio.gather(*(tell(name) for name in names))


async def drop(database: Any, name: str, last: Mapping[str, Any] | None = None) -> None:
    """Drop an inbox. Only the relay writes one, so it drops it, after its last frame (an
    insert into a dropped collection would make it again). ``last``, if given, is inserted
    first: a drop does not wake a tailing ``getMore`` that waits (it returns after
    ``AWAIT_MS``), an insert does."""
    if last is not None:
        try:
            await database[name].with_options(write_concern=HINT).insert_one(dict(last))
        except PyMongoError as exc:
            log.debug("cannot write the last frame of inbox %s: %s", name, exc)
    try:
        await database.drop_collection(name)
    except PyMongoError as exc:
        log.debug("cannot drop inbox %s: %s", name, exc)


async def ensure_capped(database: Any, name: str, size: int, at: Any = None) -> Any:
    """The capped collection ``name`` (made if missing, with its marker, which says when:
    ``at``, from a server-synced clock). One that exists but is not capped (an insert made it
    first) is converted, by the server."""
    try:
        await database.create_collection(name, capped=True, size=size)
    except (CollectionInvalid, OperationFailure) as exc:
        if isinstance(exc, OperationFailure) and exc.code != NAMESPACE_EXISTS:
            raise
        found = await (await database.list_collections(filter={"name": name})).to_list(1)
        if found and not (found[0].get("options") or {}).get("capped"):
            log.warning("%s is not a capped collection: converting it", name)
            await database.command("convertToCapped", name, size=size)
    collection = database[name]
    await collection.insert_one({**MARKER, "at": at})
    return collection


async def tail(
    collection: Any, query: Mapping[str, Any] | None = None
) -> AsyncGenerator[Any, None]:
    """The documents of a capped collection as they are inserted, from its start; ends when
    the server closes the cursor (the collection was dropped, or the cursor fell behind its
    capped size). The query must match the marker."""
    cursor = collection.find(query or {}, cursor_type=CursorType.TAILABLE_AWAIT)
    cursor = cursor.max_await_time_ms(AWAIT_MS)
    try:
        while cursor.alive:
            try:
                doc = await cursor.next()
            except StopAsyncIteration:
                continue  # no frame within AWAIT_MS: wait again
            if not doc.get("marker"):
                yield doc
    finally:
        await cursor.close()


async def read_reports(
    database: Any, tasks: str, relay: str, read: Callable[[Mapping[str, Any]], None]
) -> None:
    """Until cancelled: each frame addressed to ``relay`` in the relay's inbox (made if
    missing), as it comes, to ``read``. MongoDB away is weather: read again."""
    query = {"$or": [{"to": relay}, dict(MARKER)]}
    name = reports_name(tasks)
    while True:
        try:
            reports = await ensure_capped(database, name, REPORTS_BYTES)
            async for doc in tail(reports, query):
                read(doc)
        except PyMongoError as exc:
            log.warning("reading the subscribers' reports failed, again: %s", exc)
            await asyncio.sleep(0.5)


class Writer:
    """Inserts frames into one collection in the order given, batched per turn of the event
    loop, without blocking whoever sends them. ``failed`` is called (once) if a write fails;
    ``gate``, if given, is awaited before each write (the relay's: while its lease is fresh)."""

    def __init__(
        self,
        collection: Any,
        failed: Callable[[Exception], None],
        gate: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        # a frame is a hint (the claim decides, the sweep bounds a loss): acknowledged by the
        # primary, not waited on for a majority
        self.collection = collection.with_options(write_concern=HINT)
        self.failed = failed
        self.gate = gate
        self.pending: collections.deque[Mapping[str, Any]] = collections.deque()
        self.in_flight = 0
        self._ready = asyncio.Event()
        self._written = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.closed = False

    def put(self, doc: Mapping[str, Any]) -> None:
        if self.closed:
            return
        self.pending.append(doc)
        self._ready.set()
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._write(), name="mtask-wire")

    def __len__(self) -> int:
        return len(self.pending) + self.in_flight

    async def _write(self) -> None:
        while not self.closed:
            await self._ready.wait()
            self._ready.clear()
            while self.pending and not self.closed:
                if self.gate is not None:
                    await self.gate()
                batch = list(self.pending)
                self.pending.clear()
                self.in_flight = len(batch)
                try:
                    await self.collection.insert_many(batch, ordered=True)
                except PyMongoError as exc:
                    self.close()
                    self.failed(exc)
                    return
                finally:
                    self.in_flight = 0
                    self._written.set()

    def close(self) -> None:
        self.closed = True
        self.pending.clear()
        if self._task is not None and self._task is not asyncio.current_task():
            self._task.cancel()

    async def drain(self) -> None:
        """Wait until what was put is written (a goodbye before closing), ``DRAIN`` seconds
        at most."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(DRAIN):
                while len(self) and not self.closed:
                    self._written.clear()
                    await self._written.wait()


__all__ = [
    "AWAIT_MS",
    "INBOX_BYTES",
    "REPORTS_BYTES",
    "Writer",
    "ensure_capped",
    "inbox_name",
    "is_inbox",
    "reports_name",
    "tail",
]
