"""Waiting for a task's outcome and following task events, on MongoDB change streams.

``AsyncWaiter`` / ``SyncWaiter`` multiplex every ``wait`` of one client over ONE change stream,
opened on the first wait and closed when no wait remains. The stream only carries events that
set a finished status (filtered on the server, projected to the document key); an event for a
waited key makes the waiter re-read that document. Races: a wait registers itself, then makes
sure the stream is open, THEN reads the document, so an outcome written before the read is seen
by the read and one written after it arrives on the stream. When the stream breaks it is
resumed with its resume token; whenever it is (re)opened — resumed, or opened afresh after its
history was lost or it was invalidated — the waiter re-reads every waited document, so nothing
is missed.

``events`` / ``sync_events`` follow task state changes across the cluster: one ``TaskEvent``
per insert or status change (name and status filtered on the server), each carrying the
stream's resume token as an opaque string; pass the last one as ``resume_after`` to continue
exactly after it. Change streams go around the store seam (like the worker's watcher): they are
long-lived cursors, not ``Call``s.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import datetime as dt
import logging
import threading
import time
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from pymongo.asynchronous.collection import AsyncCollection
from pymongo.errors import OperationFailure, PyMongoError
from pymongo.synchronous.collection import Collection

from mtask.driver import Doc
from mtask.errors import EventsLost, StorageError, TaskNotFound, WaitTimeout
from mtask.models import FINISHED_STATUSES

log = logging.getLogger("mtask.events")
FINISHED = sorted(s.value for s in FINISHED_STATUSES)
HISTORY_LOST = {136, 280, 286}  # CappedPositionLost, ChangeStreamFatalError, HistoryLost
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


def events_pipeline(names: Iterable[str] | None, statuses: Iterable[str] | None) -> list[Doc]:
    """Inserts and status changes, filtered on name and status, projected to what a
    ``TaskEvent`` holds. The status is the one the change wrote (``updatedFields``), not the
    looked-up document's current one: a consumer that resumes late still sees every step."""
    kinds: Doc = {
        "$or": [
            {"operationType": {"$in": ["insert", "replace"]}},
            {"updateDescription.updatedFields.status": {"$exists": True}},
        ],
        "fullDocument": {"$type": "object"},
    }
    project = {
        "clusterTime": 1,
        "operationType": 1,
        "documentKey": 1,
        "name": "$fullDocument.name",
        "status": {"$ifNull": ["$updateDescription.updatedFields.status", "$fullDocument.status"]},
    }
    match: Doc = {}
    if names is not None:
        match["name"] = {"$in": list(names)}
    if statuses is not None:
        match["status"] = {"$in": list(statuses)}
    stages = [{"$match": kinds}, {"$project": project}]
    return [*stages, {"$match": match}] if match else stages


@dataclass(frozen=True)
class TaskEvent:
    """One task state change. ``token`` is opaque: give it back as ``resume_after``."""

    key: Any
    name: Any
    status: Any
    token: str
    cluster_time: dt.datetime | None
    operation: str

    def to_json(self) -> dict[str, Any]:
        time = self.cluster_time.isoformat() if self.cluster_time else None
        return {
            "key": self.key,
            "name": self.name,
            "status": self.status,
            "token": self.token,
            "cluster_time": time,
            "operation": self.operation,
        }


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
    )


def _lost(exc: OperationFailure) -> bool:
    return exc.code in HISTORY_LOST


# -- events ------------------------------------------------------------------------------------


async def events(
    collection: AsyncCollection[Doc],
    names: Iterable[str] | None = None,
    statuses: Iterable[str] | None = None,
    resume_after: str | None = None,
    *,
    retry_for: float = 60.0,
    opened: asyncio.Event | None = None,
) -> AsyncIterator[TaskEvent]:
    """Task events for ever; reconnects (resuming after the last event) when MongoDB is out of
    reach for less than ``retry_for`` seconds. Raises ``EventsLost`` if the history after the
    token is gone (a consumer must then re-read what it cares about). ``opened`` is set once
    the stream is open: every change after that is delivered."""
    pipeline = events_pipeline(names, statuses)
    token = resume_after
    loop = asyncio.get_running_loop()
    failing_since: float | None = None
    backoff = 0.05
    ever_opened = False
    while True:
        try:
            async with await collection.watch(
                pipeline,
                full_document="updateLookup",
                resume_after=resume_token(token),
                max_await_time_ms=AWAIT_MS,
            ) as stream:
                failing_since, backoff, ever_opened = None, 0.05, True
                if opened is not None:
                    opened.set()
                async for change in stream:
                    if change.get("operationType") == "invalidate":
                        raise EventsLost("the collection was dropped or renamed")
                    event = to_event(change)
                    token = event.token
                    yield event
        except OperationFailure as exc:
            if _lost(exc):
                raise EventsLost(f"the change stream's history is lost: {exc}") from None
            if (
                token is not None
                and not ever_opened
                and not exc.has_error_label("ResumableChangeStreamError")
            ):
                raise EventsLost(f"cannot resume after token {token[:40]}…: {exc}") from None
            failing_since = _check_retry(loop, failing_since, retry_for, exc)
        except PyMongoError as exc:
            failing_since = _check_retry(loop, failing_since, retry_for, exc)
        await asyncio.sleep(backoff)
        backoff = min(backoff * 2, 2.0)


def _check_retry(
    loop: asyncio.AbstractEventLoop, since: float | None, retry_for: float, exc: Exception
) -> float:
    now = loop.time()
    since = now if since is None else since
    if now - since > retry_for:
        raise StorageError(f"change stream failed for {retry_for:g} s: {exc}", transient=True)
    log.warning("event stream interrupted, resuming: %s", exc)
    return since


def sync_events(
    collection: Collection[Doc],
    names: Iterable[str] | None = None,
    statuses: Iterable[str] | None = None,
    resume_after: str | None = None,
) -> Iterator[TaskEvent]:
    """``events`` for code without an event loop (pymongo resumes once by itself on a
    resumable error; a longer outage raises ``StorageError``: reconnect with the last token)."""
    try:
        with collection.watch(
            events_pipeline(names, statuses),
            full_document="updateLookup",
            resume_after=resume_token(resume_after),
        ) as stream:
            for change in stream:
                if change.get("operationType") == "invalidate":
                    raise EventsLost("the collection was dropped or renamed")
                yield to_event(change)
    except OperationFailure as exc:
        if _lost(exc):
            raise EventsLost(f"the change stream's history is lost: {exc}") from None
        raise StorageError(f"change stream failed: {exc}", transient=True) from None
    except PyMongoError as exc:
        raise StorageError(f"change stream failed: {exc}", transient=True) from None


# -- waiting -----------------------------------------------------------------------------------


def finished(doc: Mapping[str, Any] | None) -> bool:
    return doc is not None and doc.get("status") in FINISHED


class AsyncWaiter:
    """Every ``wait`` of one ``AsyncTaskClient``, over one change stream."""

    def __init__(self, collection: AsyncCollection[Doc]) -> None:
        self.collection = collection
        self.waiting: dict[Any, set[asyncio.Future[Doc]]] = {}
        self.ready = asyncio.Event()
        self.opened = 0
        """How many times the stream was opened or resumed (for tests and logs)."""
        self._task: asyncio.Task[None] | None = None

    async def wait(self, key: str, timeout: float | None) -> Doc:  # noqa: ASYNC109
        future: asyncio.Future[Doc] = asyncio.get_running_loop().create_future()
        self.waiting.setdefault(key, set()).add(future)
        try:
            async with asyncio.timeout(timeout):
                if self._task is None or self._task.done():
                    self.ready.clear()
                    self._task = asyncio.create_task(self._run(), name="mtask-waiter")
                await self.ready.wait()  # the stream is open: from here on nothing is missed
                doc = await self.collection.find_one({"_id": key})
                if doc is None:
                    raise TaskNotFound(key)
                if finished(doc):
                    return doc
                return await future
        except TimeoutError:
            raise WaitTimeout(key, timeout) from None
        finally:
            self._forget(key, future)

    def _forget(self, key: Any, future: asyncio.Future[Doc]) -> None:
        futures = self.waiting.get(key, set())
        futures.discard(future)
        if not futures:
            self.waiting.pop(key, None)
        if not self.waiting and self._task is not None:
            self._task.cancel()  # the last wait ended: close the stream
            self._task = None

    def _resolve(self, docs: Iterable[Doc]) -> None:
        for doc in docs:
            for future in self.waiting.get(doc["_id"], ()):
                if not future.done():
                    future.set_result(doc)

    async def _reread(self, keys: list[Any]) -> None:
        if keys:
            query = {"_id": {"$in": keys}, "status": {"$in": FINISHED}}
            self._resolve([d async for d in self.collection.find(query)])

    async def _run(self) -> None:
        token: Mapping[str, Any] | None = None
        backoff = 0.05
        while True:
            try:
                async with await self.collection.watch(
                    finish_pipeline(), resume_after=token, max_await_time_ms=AWAIT_MS
                ) as stream:
                    self.opened += 1
                    await self._reread(list(self.waiting))  # whatever the gap held
                    self.ready.set()
                    backoff = 0.05
                    while stream.alive:
                        change = await stream.try_next()
                        token = stream.resume_token
                        if change is None:
                            continue
                        if change.get("operationType") == "invalidate":
                            token = None
                            break
                        key = change["documentKey"]["_id"]
                        if key in self.waiting:
                            await self._reread([key])
            except OperationFailure as exc:
                if _lost(exc):
                    token = None  # open afresh; the re-read covers the gap
                log.warning("wait stream failed, reopening: %s", exc)
            except PyMongoError as exc:
                log.warning("wait stream interrupted, resuming: %s", exc)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 2.0)


class SyncWaiter:
    """Every ``wait`` of one ``TaskClient`` (from any thread), over one change stream read by a
    background thread that exits when no wait remains."""

    def __init__(self, collection: Collection[Doc]) -> None:
        self.collection = collection
        self.waiting: dict[Any, set[concurrent.futures.Future[Doc]]] = {}
        self.lock = threading.Lock()
        self.ready = threading.Event()
        """Set by the current stream thread once its stream is open (each thread has its own:
        a stopping thread never speaks for its successor)."""
        self.opened = 0
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def wait(self, key: str, timeout: float | None) -> Doc:
        future: concurrent.futures.Future[Doc] = concurrent.futures.Future()
        with self.lock:
            self.waiting.setdefault(key, set()).add(future)
            if self._thread is None or not self._thread.is_alive():
                self.ready = threading.Event()
                self._stop = threading.Event()
                self._thread = threading.Thread(
                    target=self._run,
                    args=(self._stop, self.ready),
                    name="mtask-waiter",
                    daemon=True,
                )
                self._thread.start()
            ready = self.ready
        deadline = None if timeout is None else _monotonic() + timeout
        try:
            if not ready.wait(timeout):
                raise WaitTimeout(key, timeout)
            doc = self.collection.find_one({"_id": key})
            if doc is None:
                raise TaskNotFound(key)
            if finished(doc):
                return doc
            left = None if deadline is None else max(0.0, deadline - _monotonic())
            try:
                return future.result(left)
            except concurrent.futures.TimeoutError:
                raise WaitTimeout(key, timeout) from None
        finally:
            self._forget(key, future)

    def _forget(self, key: Any, future: concurrent.futures.Future[Doc]) -> None:
        with self.lock:
            futures = self.waiting.get(key, set())
            futures.discard(future)
            if not futures:
                self.waiting.pop(key, None)
            if not self.waiting:
                self._stop.set()
                self._thread = None

    def _reread(self, keys: list[Any]) -> None:
        if not keys:
            return
        for doc in self.collection.find({"_id": {"$in": keys}, "status": {"$in": FINISHED}}):
            with self.lock:
                futures = list(self.waiting.get(doc["_id"], ()))
            for future in futures:
                with contextlib.suppress(concurrent.futures.InvalidStateError):
                    future.set_result(doc)

    def _run(self, stop: threading.Event, ready: threading.Event) -> None:
        token: Mapping[str, Any] | None = None
        backoff = 0.05
        while not stop.is_set():
            try:
                with self.collection.watch(
                    finish_pipeline(), resume_after=token, max_await_time_ms=AWAIT_MS
                ) as stream:
                    self.opened += 1
                    with self.lock:
                        keys = list(self.waiting)
                    self._reread(keys)
                    ready.set()
                    backoff = 0.05
                    while stream.alive and not stop.is_set():
                        change = stream.try_next()
                        token = stream.resume_token
                        if change is None:
                            continue
                        if change.get("operationType") == "invalidate":
                            token = None
                            break
                        key = change["documentKey"]["_id"]
                        if key in self.waiting:
                            self._reread([key])
            except OperationFailure as exc:
                if _lost(exc):
                    token = None
                log.warning("wait stream failed, reopening: %s", exc)
            except PyMongoError as exc:
                log.warning("wait stream interrupted, resuming: %s", exc)
            stop.wait(backoff)
            backoff = min(backoff * 2, 2.0)


def _monotonic() -> float:
    return time.monotonic()
