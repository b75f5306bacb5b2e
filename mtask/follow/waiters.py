"""Waiting for a task's outcome, on one change stream per MongoClient, database and collection.

``AsyncWaiter`` / ``SyncWaiter`` multiplex every ``wait`` made through one MongoClient on one
collection over ONE change stream, opened on the first wait and closed when no wait remains:
``waiter_for`` / ``async_waiter_for`` hand every ``TaskClient`` built on the same MongoClient
the same waiter (a process normally has one MongoClient, hence one stream; separate
MongoClients -- and the sync and async sides -- have a stream each). The stream only carries
events that set a finished status (filtered on the server, projected to the document key); an
event for a waited key makes the waiter re-read that document. Races: a wait registers itself,
then makes sure the stream is open, THEN reads the document, so an outcome written before the
read is seen by the read and one written after it arrives on the stream. The stream is reopened
by ``mtask.follow.events.follow`` at its resume token; whenever it is (re)opened -- resumed, or
opened afresh after its history was lost or it was invalidated -- the waiter re-reads every waited
document, so nothing is missed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import time
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

from pymongo.asynchronous.collection import AsyncCollection
from pymongo.synchronous.collection import Collection

from mtask.driver import Doc
from mtask.errors import TaskNotFound, WaitTimeout
from mtask.follow.events import FINISHED, Position, finish_pipeline, follow, sync_follow

_shared: weakref.WeakValueDictionary[tuple[str, int, str, str], Any] = weakref.WeakValueDictionary()
_shared_lock = threading.Lock()


def _key(
    kind: str, collection: AsyncCollection[Doc] | Collection[Doc]
) -> tuple[str, int, str, str]:
    # id() is safe: a live waiter holds its collection, hence its MongoClient
    return (kind, id(collection.database.client), collection.database.name, collection.name)


def waiter_for(collection: Collection[Doc]) -> SyncWaiter:
    """The one ``SyncWaiter`` of this MongoClient, database and collection."""
    with _shared_lock:
        waiter = _shared.get(_key("sync", collection))
        if waiter is None:
            waiter = _shared[_key("sync", collection)] = SyncWaiter(collection)
        return waiter


def async_waiter_for(collection: AsyncCollection[Doc]) -> AsyncWaiter:
    """The one ``AsyncWaiter`` of this AsyncMongoClient, database and collection."""
    with _shared_lock:
        waiter = _shared.get(_key("async", collection))
        if waiter is None:
            waiter = _shared[_key("async", collection)] = AsyncWaiter(collection)
        return waiter


def finished(doc: Mapping[str, Any] | None) -> bool:
    return doc is not None and doc.get("status") in FINISHED


def _finished_among(keys: list[Any]) -> Doc:
    return {"_id": {"$in": keys}, "status": {"$in": FINISHED}}


class AsyncWaiter:
    """Every ``wait`` on one collection of one AsyncMongoClient, over one change stream."""

    def __init__(self, collection: AsyncCollection[Doc]) -> None:
        self.collection = collection
        self.waiting: dict[str, set[asyncio.Future[Doc]]] = {}
        self.ready = asyncio.Event()
        self.opened = 0
        """How many times the stream was opened or reopened (for tests and logs)."""
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
            self._resolve([d async for d in self.collection.find(_finished_among(keys))])

    async def _opened(self) -> None:
        self.opened += 1
        await self._reread(list(self.waiting))  # whatever the gap held
        self.ready.set()

    async def _run(self) -> None:
        at = Position(fresh_when_lost=True)
        changes = follow(self.collection, finish_pipeline(), at, on_open=self._opened)
        async with contextlib.aclosing(changes):
            async for change in changes:
                key = change["documentKey"]["_id"]
                if isinstance(key, str) and key in self.waiting:  # a key may be a document
                    await self._reread([key])


class SyncWaiter:
    """Every ``wait`` on one collection of one MongoClient (from any thread), over one change
    stream read by a background thread that exits when no wait remains."""

    def __init__(self, collection: Collection[Doc]) -> None:
        self.collection = collection
        self.waiting: dict[str, set[concurrent.futures.Future[Doc]]] = {}
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
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            if not ready.wait(timeout):
                raise WaitTimeout(key, timeout)
            doc = self.collection.find_one({"_id": key})
            if doc is None:
                raise TaskNotFound(key)
            if finished(doc):
                return doc
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
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

    def _waited(self) -> list[Any]:
        with self.lock:
            return list(self.waiting)

    def _is_waited(self, key: Any) -> bool:
        with self.lock:
            return isinstance(key, str) and key in self.waiting  # a key may be a document

    def _reread(self, keys: list[Any]) -> None:
        if not keys:
            return
        for doc in self.collection.find(_finished_among(keys)):
            with self.lock:
                futures = list(self.waiting.get(doc["_id"], ()))
            for future in futures:
                with contextlib.suppress(concurrent.futures.InvalidStateError):
                    future.set_result(doc)

    def _run(self, stop: threading.Event, ready: threading.Event) -> None:
        def opened() -> None:
            self.opened += 1
            self._reread(self._waited())  # whatever the gap held
            ready.set()

        at = Position(fresh_when_lost=True)
        changes = sync_follow(self.collection, finish_pipeline(), at, on_open=opened, stop=stop)
        with contextlib.closing(changes):
            for change in changes:
                key = change["documentKey"]["_id"]
                if self._is_waited(key):
                    self._reread([key])
