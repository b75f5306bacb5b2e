"""Publishing and reading tasks: ``TaskClient`` (sync) and ``AsyncTaskClient`` (asyncio).

Both take ``TaskClient(uri=None, *, database="mtask", collection="tasks")``; with no ``uri``
they use ``MTASK_MONGODB_URI``, then the embedded server. Validation happens before anything is
sent, so bad input raises ``InvalidTask`` and writes nothing. Both clients run the same
operations from ``mtask.store``.

``publish`` and ``publish_many`` take ``session=``: a pymongo session of this client's
``MongoClient`` (``client.mongo``, or the caller's own passed as ``mongo_client=``), usually with
a transaction open; then the task exists if and only if that transaction commits
(docs/transactions.md).

A client makes the collection's indexes at its first call (``ensure_indexes``);
``make_indexes=False`` leaves them to the workers and ``mtask collection init`` (a reader's
client: ``mtask get``, ``list`` and ``stats``, which reads whether they are there or not).

How the package is laid out. Every operation is written once (``core.operation``), as a
generator of the store's ``Call``s, in the part of the client its concern belongs to:

- ``publishing``: publish, publish_many, ensure_indexes (and ``build_task``, ``build_many``);
- ``reading``: get, list, output, stats, search, derived states, read tokens;
- ``acting``: cancel, retry, signal, durable steps changed, bulk actions, purge;
- ``control``: collection and roles, workers, pauses, limits, retention defaults, schedules,
  triggers;
- ``history``: the audit and the throughput.

Each part is a plain class built with the client's ``core.Core`` (names, clock, registry,
encryption, MongoClient, retention cache): composed, not inherited. ``api.Operations`` names
every operation once, one line each, and the two clients below derive from it alone: they add
only how an operation runs (``_run``; ``_bind``: run now, or awaited) and what is sync or async
by nature (``now``, ``wait``, ``events``, ``stream``, ``close``). One plain base class rather
than a delegating method per operation on each client: delegates would write every signature
and docstring twice more, and ``help()`` would be kept in step by hand; nor a mixin per part,
which would be subclassing for wiring (each part would see every other's attributes).
"""

from __future__ import annotations

import datetime as dt
import functools
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Self, TypeVar

from pymongo import AsyncMongoClient, MongoClient
from pymongo.asynchronous.client_session import AsyncClientSession
from pymongo.errors import PyMongoError
from pymongo.synchronous.client_session import ClientSession

from mtask import driver, store
from mtask.client.api import Operations
from mtask.client.checks import check_kinds, check_wait
from mtask.client.core import operation
from mtask.client.publishing import MAX_DELAY_SECONDS, build_many, build_task, delay_seconds
from mtask.clock import Clock
from mtask.connection.clients import CODEC_OPTIONS, async_client, sync_client
from mtask.driver import Op
from mtask.errors import TaskNotFound
from mtask.follow import events, streams
from mtask.follow.waiters import AsyncWaiter, SyncWaiter, async_waiter_for, finished, waiter_for
from mtask.models import Task
from mtask.vocabulary import DEFAULT_MAX_PARAMS_BYTES

if TYPE_CHECKING:
    from mtask.registry import Registry
    from mtask.security.encryption import Encryption

__all__ = [
    "MAX_DELAY_SECONDS",
    "AsyncTaskClient",
    "TaskClient",
    "build_many",
    "build_task",
    "delay_seconds",
    "operation",
]

T = TypeVar("T")


class TaskClient(Operations):
    """Synchronous client, for web apps, scripts and anything without an event loop."""

    def __init__(
        self,
        uri: str | None = None,
        *,
        database: str = "mtask",
        collection: str = "tasks",
        clock: Clock | None = None,
        max_params_bytes: int = DEFAULT_MAX_PARAMS_BYTES,
        mongo_client: MongoClient[dict[str, Any]] | None = None,
        registry: Registry | None = None,
        encryption: Encryption | None = None,
        make_indexes: bool = True,
    ) -> None:
        self._owns_client = mongo_client is None
        self.mongo: MongoClient[dict[str, Any]] = mongo_client or sync_client(uri)
        super().__init__(
            database, collection, clock, max_params_bytes, registry, encryption, self.mongo
        )
        self._make_indexes = make_indexes
        self.db = self.mongo.get_database(database, codec_options=CODEC_OPTIONS)  # a caller's
        self.collection = self.db[collection]  # client too: timezone-aware UTC dates
        self._driver = driver.SyncDriver(driver.collections(self.db, collection))
        self._waiter: SyncWaiter | None = None

    def _bind(self, build: Callable[..., Op[T]], part: type[Any]) -> Callable[..., T]:
        """An operation written in ``part`` as this client's method, run on this client's
        instance of that part (``core.operation``)."""

        @functools.wraps(build)
        def run(*args: Any, **kwargs: Any) -> T:
            return self._run(build(self._parts[part], *args, **kwargs), kwargs.get("session"))

        return run

    def _run(self, op: Op[T], session: ClientSession | None = None) -> T:
        if not self._ready:  # never in the caller's transaction
            self.now()
            if self._make_indexes:
                self._driver.run(store.ensure_indexes())
            self._ready = True
        elif self._calibration_due() is not None:
            self.now()  # calibrated again: a long-lived client follows the server's clock
        return self._driver.run(op) if session is None else self._driver.run(op, session)

    def now(self) -> dt.datetime:
        """The server's current time (the clock calibrated first, and again every
        ``clock.KEEP_BEST`` seconds: a long-lived client follows the server's clock)."""
        server_clock = self._calibration_due()
        if server_clock is not None:
            try:
                server_clock.calibrate(self.db)
            except PyMongoError as exc:
                raise driver.storage_error(exc) from exc
        return self.clock.now()

    def wait(self, key: str, timeout: float | None = None) -> Task:
        """Block until the task is finished (succeeded, failed, cancelled or invalid) and
        return it. Raises ``WaitTimeout`` after ``timeout`` seconds (None: no limit) and
        ``TaskNotFound`` if no task has that key. All waits through one MongoClient on one
        collection share one change stream (``mtask.follow.waiters``), whichever client makes
        them."""
        check_wait(key, timeout)
        doc = self._run(store.get(key))  # fails fast: no such key, finished, MongoDB away
        if doc is None:
            raise TaskNotFound(key)
        if not finished(doc):
            if self._waiter is None:
                self._waiter = waiter_for(self.collection)
            doc = self._waiter.wait(key, timeout)
        return Task.from_document(doc)

    def events(
        self,
        names: Iterable[str] | None = None,
        statuses: Iterable[str] | None = None,
        resume_after: str | None = None,
        progress: bool = False,
        steps: bool = False,
    ) -> Iterator[events.TaskEvent]:
        """Task state changes across the cluster (see ``mtask.follow.events``); ``progress``: the
        progress its runs report too (``TaskEvent.progress``); ``steps``: the durable steps they
        record and the waits they begin (``TaskEvent.steps``, ``TaskEvent.waiting``)."""
        return events.sync_events(
            self.collection, names, statuses, resume_after, progress=progress, steps=steps
        )

    def stream(
        self, key: str, after: int = 0, kinds: Sequence[str] | None = None
    ) -> Iterator[streams.Entry]:
        """Task ``key``'s log lines and chunks after ``after``, then new ones as its runs
        write them, until it is finished; resume with the last ``entry.seq`` seen as ``after``
        (none lost, none repeated; see ``mtask.follow.streams``). Raises ``TaskNotFound``."""
        check_kinds(kinds)
        return streams.sync_stream(self.db, self.collection.name, key, after, kinds)

    def close(self) -> None:
        if self._owns_client:
            self.mongo.close()
        if self.encryption is not None and self.encryption.owns_client:
            self.encryption.close()  # made by Encryption.local: its key vault's client

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncTaskClient(Operations):
    """asyncio client on pymongo's native ``AsyncMongoClient``; the same methods as
    ``TaskClient``, awaited."""

    def __init__(
        self,
        uri: str | None = None,
        *,
        database: str = "mtask",
        collection: str = "tasks",
        clock: Clock | None = None,
        max_params_bytes: int = DEFAULT_MAX_PARAMS_BYTES,
        mongo_client: AsyncMongoClient[dict[str, Any]] | None = None,
        registry: Registry | None = None,
        encryption: Encryption | None = None,
        make_indexes: bool = True,
    ) -> None:
        self._owns_client = mongo_client is None
        self.mongo: AsyncMongoClient[dict[str, Any]] = mongo_client or async_client(uri)
        super().__init__(
            database, collection, clock, max_params_bytes, registry, encryption, self.mongo
        )
        self._make_indexes = make_indexes
        self.db = self.mongo.get_database(database, codec_options=CODEC_OPTIONS)
        self.collection = self.db[collection]
        self._driver = driver.AsyncDriver(driver.collections(self.db, collection))
        self._waiter: AsyncWaiter | None = None

    def _bind(
        self, build: Callable[..., Op[T]], part: type[Any]
    ) -> Callable[..., Coroutine[Any, Any, T]]:
        """An operation written in ``part`` as this client's method, a coroutine of its run on
        this client's instance of that part (``core.operation``)."""

        @functools.wraps(build)
        async def awaited(*args: Any, **kwargs: Any) -> T:
            op = build(self._parts[part], *args, **kwargs)
            return await self._run(op, kwargs.get("session"))

        return awaited

    async def _run(self, op: Op[T], session: AsyncClientSession | None = None) -> T:
        if not self._ready:  # never in the caller's transaction
            await self.now()
            if self._make_indexes:
                await self._driver.run(store.ensure_indexes())
            self._ready = True
        elif self._calibration_due() is not None:
            await self.now()  # calibrated again: a long-lived client follows the server's clock
        if session is None:
            return await self._driver.run(op)
        return await self._driver.run(op, session)

    async def now(self) -> dt.datetime:
        """The server's current time (see ``TaskClient.now``)."""
        server_clock = self._calibration_due()
        if server_clock is not None:
            try:
                await server_clock.calibrate_async(self.db)
            except PyMongoError as exc:
                raise driver.storage_error(exc) from exc
        return self.clock.now()

    async def wait(self, key: str, timeout: float | None = None) -> Task:  # noqa: ASYNC109
        """Wait until the task is finished and return it (see ``TaskClient.wait``)."""
        check_wait(key, timeout)
        doc = await self._run(store.get(key))  # fails fast: no such key, finished, MongoDB away
        if doc is None:
            raise TaskNotFound(key)
        if not finished(doc):
            if self._waiter is None:
                self._waiter = async_waiter_for(self.collection)
            doc = await self._waiter.wait(key, timeout)
        return Task.from_document(doc)

    def events(
        self,
        names: Iterable[str] | None = None,
        statuses: Iterable[str] | None = None,
        resume_after: str | None = None,
        progress: bool = False,
        steps: bool = False,
    ) -> AsyncIterator[events.TaskEvent]:
        """Task state changes across the cluster, for ever, resuming after a lost connection;
        pass an event's ``token`` as ``resume_after`` to continue after it (see
        ``mtask.follow.events``); ``progress`` and ``steps`` as ``TaskClient.events``."""
        return events.events(
            self.collection, names, statuses, resume_after, progress=progress, steps=steps
        )

    def stream(
        self, key: str, after: int = 0, kinds: Sequence[str] | None = None
    ) -> AsyncIterator[streams.Entry]:
        """Task ``key``'s log lines and chunks after ``after``, then new ones until it is
        finished (see ``TaskClient.stream``)."""
        check_kinds(kinds)
        return streams.stream(self.db, self.collection.name, key, after, kinds)

    async def close(self) -> None:
        if self._owns_client:
            await self.mongo.close()
        if self.encryption is not None and self.encryption.owns_client:
            self.encryption.close()  # made by Encryption.local: its key vault's client

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
