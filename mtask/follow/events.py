"""Following task events, on MongoDB change streams, and the reopen loop that every change
stream of the client side shares (``follow``: the task events here, the waiters of
``mtask.follow.waiters``).

``events`` / ``sync_events`` follow task state changes across the cluster: one ``TaskEvent``
per insert or status change (name and status filtered on the server), each carrying the
stream's resume token as an opaque string; pass the last one as ``resume_after`` to continue
exactly after it. Change streams go around the store seam (like the worker's): they are
long-lived cursors, not ``Call``s.

Where a broken stream resumes (``Position``): at the stream's own resume token, which the
driver keeps at the last change *handed out* or, between changes, at the server's
``postBatchResumeToken`` -- including the one of the opening ``aggregate``, so a stream that
breaks before its first change resumes where it opened, never at "now". The driver resumes by
itself once after a resumable error (a cursor killed between two ``getMore``s, a failover); a
``getMore`` killed while it awaits changes fails with ``CursorKilled`` (``killCursors``) or
``Interrupted`` (``killOp``), which are not resumable, so ``follow`` reopens the stream from
the same position. Either way nothing is missed and nothing is handed
out twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import sys
import threading
import time
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Awaitable,
    Callable,
    Generator,
    Iterable,
    Iterator,
    Mapping,
)
from dataclasses import dataclass
from typing import Any, Literal, overload

from pymongo.asynchronous.collection import AsyncCollection
from pymongo.asynchronous.database import AsyncDatabase
from pymongo.errors import OperationFailure, PyMongoError
from pymongo.synchronous.collection import Collection
from pymongo.synchronous.database import Database

from mtask.driver import UNAUTHORIZED, Doc, cancel_requests, raise_if_cancelled
from mtask.errors import EventsLost, StorageError
from mtask.vocabulary import FINISHED_STATUSES

log = logging.getLogger("mtask.events")  # the name operators filter on, kept
FINISHED = sorted(s.value for s in FINISHED_STATUSES)
REFUSED = 10.0
"""Seconds between tries of a change stream the server refused (Unauthorized)."""
HISTORY_LOST = {
    136: "CappedPositionLost",  # the oplog rolled past the token
    260: "InvalidResumeToken",  # a token this server cannot resume from
    280: "ChangeStreamFatalError",  # e.g. the token's event is gone from the oplog
    286: "ChangeStreamHistoryLost",
}
"""The one table of server errors after which a change stream cannot resume after its token:
it opens afresh (and its consumer re-reads what it cares about) or raises ``EventsLost``.
Every change stream of mtask, the client's and the worker's, reopens by these rules."""
AWAIT_MS = 500


# -- pipelines ---------------------------------------------------------------------------------


def finish_pipeline() -> list[Doc]:
    """Events that give a task a finished status, reduced to the document key."""
    return [
        {
            "$match": {
                "$or": [
                    {"updateDescription.updatedFields.status": {"$in": FINISHED}},
                    {
                        "operationType": {"$in": ["insert", "replace"]},
                        "fullDocument.status": {"$in": FINISHED},
                    },
                ]
            }
        },
        {"$project": {"documentKey": 1}},
    ]


STEPS_WRITTEN: Doc = {
    "$filter": {
        "input": {"$objectToArray": {"$ifNull": ["$updateDescription.updatedFields", {}]}},
        "cond": {"$regexMatch": {"input": "$$this.k", "regex": r"^steps(\.[0-9]+)?$"}},
    }
}
"""The durable-step entries an update wrote, as ``{k, v}``: ``steps.N`` (an entry written at
index N) or ``steps`` (the whole array, when it was empty or missing before)."""


def events_pipeline(
    names: Iterable[str] | None,
    statuses: Iterable[str] | None,
    progress: bool = False,
    steps: bool = False,
) -> list[Doc]:
    """Inserts and status changes, filtered on name and status, projected to what a
    ``TaskEvent`` holds. The status is the one the change wrote (``updatedFields``), not the
    looked-up document's current one: a consumer that resumes late still sees every step.
    ``progress``: the updates that wrote a run's progress too (``ctx.progress``). ``steps``:
    the updates that wrote a durable step's entry or began a wait (docs/steps.md)."""
    changes: list[Doc] = [
        {"operationType": {"$in": ["insert", "replace"]}},
        {"updateDescription.updatedFields.status": {"$exists": True}},
    ]
    if progress:
        changes.append({"updateDescription.updatedFields.progress": {"$exists": True}})
    if steps:
        changes.append({"updateDescription.updatedFields.waiting": {"$exists": True}})
        changes.append({"$expr": {"$gt": [{"$size": STEPS_WRITTEN}, 0]}})
    kinds: Doc = {"$or": changes, "fullDocument": {"$type": "object"}}
    project = {
        "clusterTime": 1,
        "operationType": 1,
        "documentKey": 1,
        "name": "$fullDocument.name",
        "status": {"$ifNull": ["$updateDescription.updatedFields.status", "$fullDocument.status"]},
        **({"progress": "$updateDescription.updatedFields.progress"} if progress else {}),
        **(_steps_projection() if steps else {}),
    }
    match: Doc = {}
    if names is not None:
        match["name"] = {"$in": list(names)}
    if statuses is not None:
        match["status"] = {"$in": list(statuses)}
    stages = [{"$match": kinds}, {"$project": project}]
    return [*stages, {"$match": match}] if match else stages


def _steps_projection() -> Doc:
    """An update's written entries (``STEPS_WRITTEN``) and ``waiting``; a change MongoDB logged
    as a whole-document replace (its diff would not be smaller) carries every entry."""
    replaced = {"$eq": ["$operationType", "replace"]}
    return {
        "steps": {"$cond": [replaced, [{"k": "steps", "v": "$fullDocument.steps"}], STEPS_WRITTEN]},
        "waiting": {
            "$cond": [replaced, "$fullDocument.waiting", "$updateDescription.updatedFields.waiting"]
        },
    }


@dataclass(frozen=True)
class TaskEvent:
    """One task state change. ``token`` is opaque: give it back as ``resume_after``."""

    key: Any
    name: Any
    status: Any
    token: str
    cluster_time: dt.datetime | None
    operation: str
    progress: Mapping[str, Any] | None = None
    """With ``progress=True``: the progress this change wrote (``fraction``, ``label``,
    ``run_id``, ``attempt``, ``at``), else ``None``."""
    steps: tuple[Mapping[str, Any], ...] = ()
    """With ``steps=True``: the durable-step entries this change wrote, each with its
    ``index`` (docs/steps.md: name, kind, state, attempts, tries, ms, error, …; not the result,
    which ``client.get`` reads)."""
    waiting: Mapping[str, Any] | None = None
    """With ``steps=True``: the wait this change began (``until``, ``index``, ``step``,
    ``signal``, ``nth``), else ``None``."""

    def to_json(self) -> dict[str, Any]:
        time = self.cluster_time.isoformat() if self.cluster_time else None
        return {
            "key": self.key,
            "name": self.name,
            "status": self.status,
            "token": self.token,
            "cluster_time": time,
            "operation": self.operation,
            **({"progress": _dates_json(self.progress)} if self.progress else {}),
            **({"steps": [_step_json(s) for s in self.steps]} if self.steps else {}),
            **({"waiting": _dates_json(self.waiting)} if self.waiting else {}),
        }


def _dates_json(fields: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v.isoformat() if isinstance(v, dt.datetime) else v for k, v in fields.items()}


def _step_json(step: Mapping[str, Any]) -> dict[str, Any]:
    tries = step.get("tries")
    listed = (
        [_dates_json(t) for t in tries if isinstance(t, Mapping)] if isinstance(tries, list) else []
    )
    return {**_dates_json(step), **({"tries": listed} if "tries" in step else {})}


def written_steps(written: Any) -> tuple[Mapping[str, Any], ...]:
    """``{k, v}`` pairs of ``STEPS_WRITTEN`` as entries with their ``index``, in index order;
    results left out (they may be large). Anything malformed is skipped: events are hints."""
    found: list[tuple[int, Mapping[str, Any]]] = []
    for pair in written if isinstance(written, list) else ():
        k, v = (pair.get("k"), pair.get("v")) if isinstance(pair, Mapping) else (None, None)
        if k == "steps" and isinstance(v, list):
            found += [(i, e) for i, e in enumerate(v) if isinstance(e, Mapping)]
        elif isinstance(k, str) and k.startswith("steps.") and isinstance(v, Mapping):
            found.append((int(k[len("steps.") :]), v))
    return tuple(
        {**{f: x for f, x in entry.items() if f != "result"}, "index": i}
        for i, entry in sorted(found, key=lambda p: p[0])
    )


def token_of(resume_token: Mapping[str, Any] | None) -> str:
    return str(resume_token["_data"]) if resume_token else ""


def resume_token(token: str | None) -> Doc | None:
    return {"_data": token} if token else None


def to_event(change: Mapping[str, Any]) -> TaskEvent:
    ts = change.get("clusterTime")
    at = dt.datetime.fromtimestamp(ts.time, dt.UTC) if ts is not None else None
    return TaskEvent(
        key=(change.get("documentKey") or {}).get("_id"),
        name=change.get("name"),
        status=change.get("status"),
        token=token_of(change["_id"]),
        cluster_time=at,
        operation=str(change.get("operationType")),
        progress=change.get("progress"),
        steps=written_steps(change.get("steps")),
        waiting=waiting if isinstance(waiting := change.get("waiting"), Mapping) else None,
    )


# -- where a stream resumes, and when to give up (pure) ----------------------------------------


class Position:
    """Where a change stream (re)opens and how long to wait before reopening it after an error.

    ``token`` follows the stream's own resume token (``stream.resume_token``) -- read when the
    stream opens, after an empty batch and after each change once it was handed out -- so a
    reopen starts exactly after what the consumer has. ``fresh_when_lost``: a waiter opens
    afresh when the history after its token is gone or the collection was dropped (it re-reads
    what it waits for); an events consumer gets ``EventsLost`` instead. ``give_up_after``: raise
    ``StorageError`` when reopening has failed for that long (None: never)."""

    def __init__(
        self,
        token: Mapping[str, Any] | None = None,
        *,
        fresh_when_lost: bool = False,
        give_up_after: float | None = None,
        lost_codes: Mapping[int, str] = HISTORY_LOST,
    ) -> None:
        self.token = token
        self.lost_codes = lost_codes
        """The server's errors after which the stream cannot go on after ``token``
        (``HISTORY_LOST``; a trigger that requires post-images adds the missing image's)."""
        self.fresh_when_lost = fresh_when_lost
        self.give_up_after = give_up_after
        self.from_caller = token is not None
        self.ever_opened = False
        self.failing_since: float | None = None
        self.delay = 0.05
        self.restarts = 0
        """Reopens after an error or a lost history (not those asked for by ``switch``)."""
        self.refused = False
        """The server refused this stream (Unauthorized) since it last opened: said once."""
        self.streaming = False
        """A stream is open at this position now."""
        self.switching = False
        self.buffered = True
        """After a change was handed out: whether the stream holds more it has read already
        (its next read sends no ``getMore``); ``True`` when that cannot be told."""

    def switch(self) -> None:
        """Reopen the open stream after the change just handed out, without ``on_open`` (no
        gap: it resumes there), so that it reads a new pipeline. A stream not open now reads
        the new one when it opens."""
        self.switching = self.streaming

    def opened(self, stream_token: Mapping[str, Any] | None) -> None:
        self.ever_opened, self.failing_since, self.delay = True, None, 0.05
        self.refused = False
        self.moved(stream_token)

    def moved(self, stream_token: Mapping[str, Any] | None) -> None:
        if stream_token is not None:
            self.token = stream_token

    def lost(self, why: str) -> None:
        """The stream cannot continue after ``token``: open afresh, or raise ``EventsLost``."""
        if not self.fresh_when_lost:
            raise EventsLost(why)
        log.warning("change stream lost (%s): opening afresh", why)
        self.token = None
        self.restarts += 1

    def failed(self, exc: PyMongoError | StorageError, now: float) -> float:
        """Decide after ``exc``: returns how long to wait before reopening, or raises."""
        if isinstance(exc, OperationFailure):
            if exc.code in self.lost_codes:
                self.lost(f"the change stream's history is lost: {exc}")
            elif (
                self.from_caller
                and not self.ever_opened
                and not exc.has_error_label("ResumableChangeStreamError")
            ):
                token = token_of(self.token)
                raise EventsLost(f"cannot resume after token {token[:40]}…: {exc}") from None
        self.failing_since = now if self.failing_since is None else self.failing_since
        if self.give_up_after is not None and now - self.failing_since > self.give_up_after:
            raise StorageError(
                f"change stream failed for {self.give_up_after:g} s: {exc}", transient=True
            )
        self.restarts += 1
        if isinstance(exc, OperationFailure) and exc.code == UNAUTHORIZED:
            # a role without the stream's privileges: said once a streak (not the command the
            # server quotes), tried again less often, in case the role is granted them
            said = str(exc).split(" to execute command")[0]
            if not self.refused:
                log.warning("change stream refused, trying again every %gs: %s", REFUSED, said)
            self.refused = True
            return REFUSED
        log.warning("change stream interrupted, reopening: %s", exc)
        delay, self.delay = self.delay, min(self.delay * 2, 2.0)
        return delay


def _invalidated(change: Mapping[str, Any]) -> bool:
    return change.get("operationType") == "invalidate"


# -- the reopen loop, async and sync -------------------------------------------------------------


async def follow(
    collection: AsyncCollection[Doc],
    pipeline: list[Doc],
    at: Position,
    *,
    full_document: str | None = None,
    on_open: Callable[[], Awaitable[None]] | None = None,
) -> AsyncGenerator[Doc, None]:
    """The changes of one change stream for ever, reopened at ``at`` after every error; runs
    ``on_open`` each time the stream is (re)opened. Close it (``contextlib.aclosing``) to close
    the stream."""
    waits = follow_waits(
        collection, lambda: pipeline, at, full_document=full_document, on_open=on_open
    )
    async with contextlib.aclosing(waits):
        async for change in waits:
            if change is not None:
                yield change


async def follow_waits(
    source: AsyncCollection[Doc] | AsyncDatabase[Doc],
    pipeline: Callable[[], list[Doc]],
    at: Position,
    *,
    full_document: str | None = None,
    batch_size: int | None = None,
    on_open: Callable[[], Awaitable[None]] | None = None,
    await_ms: int = AWAIT_MS,
) -> AsyncGenerator[Doc | None, None]:
    """The reopen loop itself: each change, and ``None`` after a wait that brought none (a
    consumer settles what it owes then); ``on_open`` after each (re)open but one asked for by
    ``at.switch()``: a failure there (``StorageError`` included) reopens as a failed stream
    does. ``source`` is a collection or a whole database (the worker follows its tasks and
    their controls, limits and schedules on one stream); ``pipeline`` is read at each open.
    ``await_ms``: how long a ``getMore`` waits for changes (a trigger's idle stream waits
    longer than the worker's own)."""
    while True:
        delay = 0.05
        try:
            async with await source.watch(
                pipeline(),
                full_document=full_document,
                resume_after=at.token,
                max_await_time_ms=await_ms,
                batch_size=batch_size,
            ) as stream:
                at.opened(stream.resume_token)
                switched, at.switching, at.streaming = at.switching, False, True
                if not switched and on_open is not None:
                    await on_open()  # after the stream is open: nothing slips between
                while stream.alive and not at.switching:
                    before = cancel_requests()
                    change = await stream.try_next()
                    raise_if_cancelled(before)  # pymongo's send may swallow one (driver.py)
                    if change is not None and _invalidated(change):
                        at.lost("the collection was dropped or renamed")
                        break
                    at.buffered = _buffered(stream)
                    yield change  # handed out: only now may the position move past it
                    at.moved(stream.resume_token)
                if at.switching:
                    delay = 0.0  # a new pipeline, resumed after the last change: at once
        except (PyMongoError, StorageError) as exc:
            at.switching = False
            delay = at.failed(exc, time.monotonic())
        finally:
            at.streaming = False
        await asyncio.sleep(delay)


def _buffered(stream: Any) -> bool:
    """Whether ``stream`` holds changes it has read and not handed out. PyMongo says so nowhere
    public: its cursor's buffer is read, and ``True`` said when it cannot be (a consumer then
    reads on at once, as it would without knowing; tests/integration/test_events.py checks that the
    installed PyMongo can be read)."""
    data = getattr(getattr(stream, "_cursor", None), "_data", None)
    return True if data is None else len(data) > 0


def _close(stream: Any) -> None:
    """Close a change stream, but not while the interpreter shuts down: a generator abandoned
    by its caller (``client.stream``'s iterator left unfinished) is closed then, when pymongo
    can no longer import what killing a cursor needs; the server drops the cursor with the
    connection."""
    if sys.is_finalizing():
        return
    stream.close()


@overload
def sync_follow(
    collection: Collection[Doc] | Database[Doc],
    pipeline: list[Doc],
    at: Position,
    *,
    full_document: str | None = None,
    on_open: Callable[[], None] | None = None,
    stop: threading.Event | None = None,
    quiet: Literal[False] = False,
) -> Generator[Doc, None, None]: ...


@overload
def sync_follow(
    collection: Collection[Doc] | Database[Doc],
    pipeline: list[Doc],
    at: Position,
    *,
    full_document: str | None = None,
    on_open: Callable[[], None] | None = None,
    stop: threading.Event | None = None,
    quiet: Literal[True],
) -> Generator[Doc | None, None, None]: ...


def sync_follow(
    collection: Collection[Doc] | Database[Doc],
    pipeline: list[Doc],
    at: Position,
    *,
    full_document: str | None = None,
    on_open: Callable[[], None] | None = None,
    stop: threading.Event | None = None,
    quiet: bool = False,
) -> Generator[Doc | None, None, None]:
    """``follow`` without an event loop; ends when ``stop`` is set. ``quiet``: yield
    ``None`` after a wait that brought no change too (as ``follow_waits`` does)."""
    stop = stop or threading.Event()
    while not stop.is_set():
        delay = 0.05
        try:
            stream = collection.watch(
                pipeline,
                full_document=full_document,
                resume_after=at.token,
                max_await_time_ms=AWAIT_MS,
            )
            try:
                at.opened(stream.resume_token)
                if on_open is not None:
                    on_open()
                while stream.alive and not stop.is_set():
                    change = stream.try_next()
                    if change is not None and _invalidated(change):
                        at.lost("the collection was dropped or renamed")
                        break
                    if change is not None or quiet:
                        yield change
                    at.moved(stream.resume_token)
            finally:
                _close(stream)
        except PyMongoError as exc:
            delay = at.failed(exc, time.monotonic())
        stop.wait(delay)


# -- events ------------------------------------------------------------------------------------


async def events(
    collection: AsyncCollection[Doc],
    names: Iterable[str] | None = None,
    statuses: Iterable[str] | None = None,
    resume_after: str | None = None,
    *,
    retry_for: float = 60.0,
    opened: asyncio.Event | None = None,
    progress: bool = False,
    steps: bool = False,
) -> AsyncIterator[TaskEvent]:
    """Task events for ever; reconnects (resuming after the last event handed out) when MongoDB
    is out of reach for less than ``retry_for`` seconds, else raises ``StorageError``. Raises
    ``EventsLost`` if the history after the position is gone (a consumer must then re-read what
    it cares about). ``opened`` is set once the stream is open: every change after that is
    delivered, once."""
    at = Position(resume_token(resume_after), give_up_after=retry_for)

    async def on_open() -> None:
        if opened is not None:
            opened.set()

    changes = follow(
        collection,
        events_pipeline(names, statuses, progress, steps),
        at,
        full_document="updateLookup",
        on_open=on_open,
    )
    async with contextlib.aclosing(changes):
        async for change in changes:
            yield to_event(change)


def sync_events(
    collection: Collection[Doc],
    names: Iterable[str] | None = None,
    statuses: Iterable[str] | None = None,
    resume_after: str | None = None,
    *,
    retry_for: float = 60.0,
    progress: bool = False,
    steps: bool = False,
) -> Iterator[TaskEvent]:
    """``events`` for code without an event loop (close the iterator to close the stream)."""
    at = Position(resume_token(resume_after), give_up_after=retry_for)
    changes = sync_follow(
        collection,
        events_pipeline(names, statuses, progress, steps),
        at,
        full_document="updateLookup",
    )
    with contextlib.closing(changes):
        for change in changes:
            yield to_event(change)
