"""Following a task's live output: its log lines and chunks, in order, exactly once, resumable.

``stream`` / ``sync_stream`` yield the task's entries (``Entry``) after a sequence number, then
follow new ones until the task is finished. Each entry's ``seq`` is its position in the task's
output (``store.output``); give the last one seen back as ``after`` and the stream goes on from
the next, none lost and none repeated: across a reconnect, a worker's takeover, or a retry.

The change stream is a hint, never the data: the stream follows inserts into the output
collection for this key and the task's status changes, on one change stream of the database,
and every entry handed out comes from a read of ``seq > last`` (majority read concern: what a
failover could roll back is never shown). An insert numbered at most ``last`` is skipped; any
other event, and every (re)open of the change stream, reads what follows ``last``. Once the
task is finished (or gone) one more read takes what is left, and the stream ends. Entries
commit in ``seq`` order (docs/output.md), so a read never skips one that commits later.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import itertools
import json
from collections.abc import AsyncGenerator, AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pymongo.asynchronous.database import AsyncDatabase
from pymongo.read_concern import ReadConcern
from pymongo.synchronous.database import Database

from mtask.driver import AsyncDriver, Doc, Op, SyncDriver
from mtask.errors import TaskNotFound
from mtask.follow.events import Position, follow_waits, sync_follow
from mtask.store import output as store_output
from mtask.store import streams as store_streams
from mtask.vocabulary import FINISHED_STATUSES

FINISHED = frozenset(s.value for s in FINISHED_STATUSES)


@dataclass(frozen=True)
class Entry:
    """One log line (``kind`` "log": ``level``, ``message``, ``fields``) or output chunk
    (``kind`` "chunk": ``data``) of a task's run ``run_id`` (attempt ``attempt``)."""

    seq: int
    kind: str
    run_id: str | None
    attempt: int | None
    at: dt.datetime | None
    level: str | None = None
    message: str | None = None
    fields: Mapping[str, Any] | None = None
    data: Any = None

    @classmethod
    def from_document(cls, doc: Mapping[str, Any]) -> Entry:
        fields = doc.get("fields")
        return cls(
            seq=int(doc["seq"]),
            kind=str(doc.get("kind")),
            run_id=doc.get("run_id"),
            attempt=doc.get("attempt"),
            at=doc.get("at"),
            level=doc.get("level"),
            message=doc.get("message"),
            fields=fields if isinstance(fields, Mapping) else None,
            data=doc.get("data"),
        )

    def to_json(self) -> dict[str, Any]:
        """JSON-ready (bytes as base64 in ``{"$binary": ...}``, dates ISO 8601)."""
        from bson import json_util

        doc: dict[str, Any] = {
            "seq": self.seq,
            "kind": self.kind,
            "run_id": self.run_id,
            "attempt": self.attempt,
            "at": self.at.isoformat() if self.at else None,
        }
        if self.kind == "log":
            doc.update(level=self.level, message=self.message, fields=self.fields or {})
        else:
            doc["data"] = self.data
        return dict(json_util.loads(json_util.dumps(doc, json_options=_JSON)))

    def text(self) -> str:
        """The entry as text: ``message k=v ...`` for a log line, the chunk itself (bytes
        decoded as UTF-8, other values as one line of JSON)."""
        if self.kind == "log":
            extras = " ".join(f"{k}={v}" for k, v in (self.fields or {}).items())
            return f"{self.message or ''} {extras}".rstrip()
        if isinstance(self.data, bytes):
            return self.data.decode("utf-8", "replace")
        if isinstance(self.data, str):
            return self.data
        return json.dumps(self.data, default=str)  # a row: as JSON, one line


def _json_options() -> Any:
    from bson import json_util

    return json_util.RELAXED_JSON_OPTIONS


_JSON = _json_options()


def pipeline(tasks: str, key: str) -> list[Doc]:
    """The change stream's filter: inserts of this task's entries, and changes of its status
    (or its removal), reduced to what the loop needs."""
    output = store_output.collection_name(tasks)
    return [
        {
            "$match": {
                "$or": [
                    {"ns.coll": output, "operationType": "insert", "fullDocument.task": key},
                    {
                        "ns.coll": tasks,
                        "documentKey._id": key,
                        "$or": [
                            {"operationType": {"$in": ["delete", "replace", "insert"]}},
                            {"updateDescription.updatedFields.status": {"$exists": True}},
                        ],
                    },
                ]
            }
        },
        {"$project": {"operationType": 1, "ns": 1, "seq": "$fullDocument.seq"}},
    ]


class Follower:
    """Where a reader is (``last``: the newest ``seq`` handed out) and whether the task's
    status must be read again (at each (re)open of the change stream, and after a status
    change). Pure: the reads are ``catch_up``'s."""

    def __init__(self, tasks: str, after: int) -> None:
        self.output = store_output.collection_name(tasks)
        self.last = after
        self.check_task = True
        self.first = True

    def opened(self) -> None:
        self.check_task = True

    def needs_read(self, change: Doc | None) -> bool:
        if change is None:
            return self.check_task
        if (change.get("ns") or {}).get("coll") == self.output:
            seq = change.get("seq")
            return not isinstance(seq, int) or seq > self.last
        self.check_task = True  # a status change or a removal
        return True


def catch_up(key: str, at: Follower, kinds: Sequence[str] | None) -> Op[tuple[list[Entry], bool]]:
    """One page of the entries after ``at.last`` (moving ``at`` past them), and whether the
    stream is over: the task was seen finished (or removed) before the page was read, and the
    page is the last. Raises ``TaskNotFound`` if the task is missing at the first read."""
    finished = False
    if at.check_task:
        doc = yield from store_streams.status_of(key)
        if doc is None and at.first:
            raise TaskNotFound(key)
        at.check_task = at.first = False
        finished = doc is None or doc.get("status") in FINISHED
    page = yield from store_streams.entries_after(key, at.last, kinds)
    if page:
        at.last = int(page[-1]["seq"])
    if len(page) == store_output.MAX_READ:
        at.check_task = at.check_task or finished  # more to read: the end comes after it
        return [Entry.from_document(d) for d in page], False
    return [Entry.from_document(d) for d in page], finished


def _collections(db: Any, tasks: str) -> dict[str, Any]:
    majority = ReadConcern("majority")  # what a failover could roll back is never shown
    return {
        "tasks": db.get_collection(tasks, read_concern=majority),
        "output": db.get_collection(store_output.collection_name(tasks), read_concern=majority),
    }


async def _now_then(waits: AsyncIterator[Doc | None]) -> AsyncGenerator[Doc | None, None]:
    """A read at once, before the change stream opens: a finished task's entries come without
    waiting for a change (or a quiet wait), and it ends without opening one; the stream's open
    then reads again, so nothing committed in between is missed."""
    yield None
    async for change in waits:
        yield change


async def stream(
    db: AsyncDatabase[Doc],
    tasks: str,
    key: str,
    after: int = 0,
    kinds: Sequence[str] | None = None,
    *,
    retry_for: float = 60.0,
) -> AsyncIterator[Entry]:
    """Task ``key``'s entries after ``after``, then new ones until it is finished. Raises
    ``TaskNotFound`` if there is no such task, ``StorageError`` if MongoDB stays out of reach
    for ``retry_for`` seconds."""
    reader = AsyncDriver(_collections(db, tasks))
    at = Follower(tasks, after)
    position = Position(fresh_when_lost=True, give_up_after=retry_for)

    async def on_open() -> None:
        at.opened()

    waits = follow_waits(db, lambda: pipeline(tasks, key), position, on_open=on_open)
    async with contextlib.aclosing(waits), contextlib.aclosing(_now_then(waits)) as changes:
        async for change in changes:
            more = at.needs_read(change)
            while more:
                entries, over = await reader.run(catch_up(key, at, kinds))
                for entry in entries:
                    yield entry
                if over:
                    return
                more = len(entries) == store_output.MAX_READ


def sync_stream(
    db: Database[Doc],
    tasks: str,
    key: str,
    after: int = 0,
    kinds: Sequence[str] | None = None,
    *,
    retry_for: float = 60.0,
) -> Iterator[Entry]:
    """``stream`` for code without an event loop (close the iterator to close the stream)."""
    reader = SyncDriver(_collections(db, tasks))
    at = Follower(tasks, after)
    position = Position(fresh_when_lost=True, give_up_after=retry_for)
    changes = sync_follow(db, pipeline(tasks, key), position, on_open=at.opened, quiet=True)
    with contextlib.closing(changes):
        for change in itertools.chain([None], changes):  # read at once (see _now_then)
            more = at.needs_read(change)
            while more:
                entries, over = reader.run(catch_up(key, at, kinds))
                yield from entries
                if over:
                    return
                more = len(entries) == store_output.MAX_READ
