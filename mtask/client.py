"""Publishing and reading tasks: ``TaskClient`` (sync) and ``AsyncTaskClient`` (asyncio).

Both take ``TaskClient(uri=None, *, database="mtask", collection="tasks")``; with no ``uri``
they use ``MTASK_MONGODB_URI``, then the embedded server. Validation happens before anything is
sent, so bad input raises ``InvalidTask`` and writes nothing. Both clients run the same
operations from ``mtask.store``.

``publish`` and ``publish_many`` take ``session=``: a pymongo session of this client's
``MongoClient`` (``client.mongo``, or the caller's own passed as ``mongo_client=``), usually with
a transaction open; then the task exists if and only if that transaction commits
(docs/transactions.md).
"""

from __future__ import annotations

import builtins
import datetime as dt
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Self

from pymongo import AsyncMongoClient, MongoClient
from pymongo.asynchronous.client_session import AsyncClientSession
from pymongo.synchronous.client_session import ClientSession

from mtask import control, driver, events, flows, limits, metrics, schedules, store, tracing
from mtask.aftercommit import after_commit
from mtask.clock import Clock, ServerClock
from mtask.connection import async_client, sync_client
from mtask.errors import InvalidTask, TaskNotFound
from mtask.models import (
    DEFAULT_MAX_PARAMS_BYTES,
    NewTask,
    OnConflict,
    PublishResult,
    Task,
    TaskOptions,
    TaskStatus,
    validate_name,
)
from mtask.store import bulk, retention, throughput

if TYPE_CHECKING:
    from mtask.registry import Registry

MAX_DELAY_SECONDS = 10 * 366 * 86400


def build_task(
    name: object,
    key: object,
    params: object = None,
    options: TaskOptions | Mapping[str, Any] | None = None,
    *,
    delay: dt.timedelta | float | None = None,
    now: dt.datetime | None = None,
    max_params_bytes: int = DEFAULT_MAX_PARAMS_BYTES,
    depends_on: Sequence[str] | None = None,
) -> NewTask:
    """Validate one publish request. ``delay`` (seconds or a timedelta, from server ``now``)
    sets ``options.run_at``; ``depends_on`` keys must all succeed before the task may run."""
    task = NewTask.build(
        name, key, params, options, max_params_bytes=max_params_bytes, depends_on=depends_on
    )
    if delay is not None:
        seconds = delay.total_seconds() if isinstance(delay, dt.timedelta) else float(delay)
        if not seconds >= 0:  # also NaN
            raise InvalidTask("must not be negative", field="delay")
        if seconds > MAX_DELAY_SECONDS:
            raise InvalidTask("must be at most ten years", field="delay")
        if task.options.run_at is not None:
            raise InvalidTask("give either delay or options.run_at, not both", field="delay")
        assert now is not None
        run_at = now + dt.timedelta(seconds=seconds)
        task = task.model_copy(
            update={"options": task.options.model_copy(update={"run_at": run_at})}
        )
    return task


def build_many(
    items: Iterable[Mapping[str, Any]], now: dt.datetime, max_params_bytes: int
) -> list[NewTask]:
    tasks = []
    for index, item in enumerate(items):
        if not isinstance(item, Mapping):
            raise InvalidTask(f"items[{index}]: must be a mapping with name, key, params, options")
        unknown = set(item) - {"name", "key", "params", "options", "delay", "depends_on"}
        if unknown:
            raise InvalidTask(f"items[{index}]: unknown field(s) {', '.join(sorted(unknown))}")
        try:
            tasks.append(
                build_task(
                    item.get("name"),
                    item.get("key"),
                    item.get("params"),
                    item.get("options"),
                    delay=item.get("delay"),
                    now=now,
                    max_params_bytes=max_params_bytes,
                    depends_on=item.get("depends_on"),
                )
            )
        except InvalidTask as exc:
            raise InvalidTask(f"items[{index}].{exc.message}") from None
    return tasks


def _check_on_conflict(on_conflict: str) -> None:
    if on_conflict not in ("ignore", "update_params", "reset"):
        raise InvalidTask(
            f"must be ignore, update_params or reset, not {on_conflict!r}", field="on_conflict"
        )


def _check_list_args(status: str | None, limit: int, order: str) -> None:
    if status is not None and status not in {s.value for s in TaskStatus}:
        raise InvalidTask(
            f"unknown status {status!r}; one of {', '.join(s.value for s in TaskStatus)}",
            field="status",
        )
    if not 1 <= limit <= 10_000:
        raise InvalidTask("must be between 1 and 10000", field="limit")
    if order not in store.LIST_ORDERS:
        raise InvalidTask(f"must be one of {', '.join(store.LIST_ORDERS)}", field="order")


def _count_created(by_name: Mapping[str, int], session: Any = None) -> None:
    """Count created tasks in ``mtask_published_total``: inside a transaction, once it has
    committed (an aborted one created nothing)."""

    def count() -> None:
        for name, created in by_name.items():
            metrics.by_name(metrics.PUBLISHED, name).inc(created)

    if by_name:
        after_commit(session, count)


def _check_session(session: Any, mongo: Any) -> None:
    """A session belongs to the MongoClient that started it; say so before pymongo does."""
    if session is not None and session.client is not mongo:
        raise InvalidTask(
            "the session was started by another MongoClient: start it from client.mongo, or "
            "build the client with mongo_client= (the MongoClient that starts your sessions)",
            field="session",
        )


def _result(published: store.Published) -> PublishResult:
    return PublishResult(
        created=published.created,
        updated=published.updated,
        task=Task.from_document(published.document),
    )


class _Base:
    def __init__(
        self,
        database: str,
        collection: str,
        clock: Clock | None,
        max_params_bytes: int,
        registry: Registry | None = None,
    ) -> None:
        self.registry = registry
        """Handlers whose declared option defaults complete this client's publishes."""
        self.database_name = database
        self.collection_name = collection
        self.max_params_bytes = max_params_bytes
        self.clock: Clock = clock or ServerClock()
        self._server_clock = self.clock if isinstance(self.clock, ServerClock) else None
        self._ready = False


class TaskClient(_Base):
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
    ) -> None:
        super().__init__(database, collection, clock, max_params_bytes, registry)
        self._owns_client = mongo_client is None
        self.mongo: MongoClient[dict[str, Any]] = mongo_client or sync_client(uri)
        self.db = self.mongo[database]
        self.collection = self.db[collection]
        self._driver = driver.SyncDriver(driver.collections(self.db, collection))
        self._waiter: events.SyncWaiter | None = None

    def _run(self, op: driver.Op[driver.T], session: ClientSession | None = None) -> driver.T:
        if not self._ready:  # never in the caller's transaction
            self._driver.run(store.ensure_indexes())
            self._ready = True
        return self._driver.run(op) if session is None else self._driver.run(op, session)

    def ensure_indexes(self) -> None:
        """Create the collection's indexes now (done anyway on the first operation). Call it
        before a transaction that publishes: an index built during a transaction makes the
        transaction's snapshot unusable (a ``TransientTransactionError``)."""
        self._run(store.get(""))

    def now(self) -> dt.datetime:
        """The server's current time."""
        if self._server_clock is not None and not self._server_clock.calibrated:
            self._server_clock.calibrate(self.db)
        return self.clock.now()

    def publish(
        self,
        name: str,
        key: str,
        params: Any = None,
        *,
        options: TaskOptions | Mapping[str, Any] | None = None,
        delay: dt.timedelta | float | None = None,
        on_conflict: OnConflict = "ignore",
        depends_on: Sequence[str] | None = None,
        session: ClientSession | None = None,
    ) -> PublishResult:
        """Publish one task (idempotent by key). With ``session``, every write joins it (and
        its transaction): its dependency bookkeeping too."""
        _check_on_conflict(on_conflict)
        _check_session(session, self.mongo)
        now = self.now()
        if self.registry is not None:  # handler defaults (issue 18)
            options = self.registry.options_for(name, options)
        task = build_task(
            name,
            key,
            params,
            options,
            delay=delay,
            now=now,
            max_params_bytes=self.max_params_bytes,
            depends_on=depends_on,
        )
        with tracing.publish_span(task.name, task.key) as trace:
            published = self._run(store.publish(task, now, on_conflict, trace=trace), session)
        _count_created({task.name: 1} if published.created else {}, session)
        if task.depends_on:
            self._run(flows.after_publish([task], now), session)
            # its dependencies may have finished already
            doc = self._run(store.get(task.key), session)
            if doc is not None:
                published = store.Published(published.created, published.updated, doc)
        return _result(published)

    def publish_many(
        self, items: Iterable[Mapping[str, Any]], *, session: ClientSession | None = None
    ) -> int:
        """Insert-if-absent many tasks; returns how many were created. ``session``: as in
        ``publish``."""
        _check_session(session, self.mongo)
        now = self.now()
        tasks = build_many(items, now, self.max_params_bytes)
        by_name: dict[str, int] = {}
        with tracing.publish_span(None, None, count=len(tasks)) as trace:
            created = self._run(
                store.publish_many(tasks, now, created_by_name=by_name, trace=trace), session
            )
        _count_created(by_name, session)
        self._run(flows.after_publish(tasks, now), session)
        return created

    def wait(self, key: str, timeout: float | None = None) -> Task:
        """Block until the task is finished (succeeded, failed, cancelled or invalid) and
        return it. Raises ``WaitTimeout`` after ``timeout`` seconds (None: no limit) and
        ``TaskNotFound`` if no task has that key. All waits of this client share one change
        stream."""
        doc = self._run(store.get(key))  # fails fast: no such key, finished, MongoDB away
        if doc is None:
            raise TaskNotFound(key)
        if not events.finished(doc):
            if self._waiter is None:
                self._waiter = events.SyncWaiter(self.collection)
            doc = self._waiter.wait(key, timeout)
        return Task.from_document(doc)

    def events(
        self,
        names: Iterable[str] | None = None,
        statuses: Iterable[str] | None = None,
        resume_after: str | None = None,
    ) -> Iterator[events.TaskEvent]:
        """Task state changes across the cluster (see ``mtask.events``)."""
        return events.sync_events(self.collection, names, statuses, resume_after)

    def flow(self, key: str) -> dict[str, Any] | None:
        """The tree of steps below ``key``: each node's key, name, status and children."""
        return self._run(flows.tree(key))

    def init_collection(self, validator: bool | None = None) -> dict[str, Any]:
        """Create the tasks collection and its indexes; ``validator=True`` installs the task
        document's ``$jsonSchema`` validator (``mtask.jsonschema``), ``False`` removes any.
        Returns the collection's options as the server reports them."""
        return self._run(store.collection_init(self.collection_name, validator))

    def get(self, key: str) -> Task | None:
        doc = self._run(store.get(key))
        return Task.from_document(doc) if doc is not None else None

    def list(
        self,
        name: str | None = None,
        status: str | None = None,
        limit: int = 100,
        after: str | None = None,
        order: str = "newest",
    ) -> list[Task]:
        _check_list_args(status, limit, order)
        docs = self._run(store.list_tasks(name, status, limit, after, order))
        return [Task.from_document(d) for d in docs]

    def stats(self) -> dict[str, dict[str, int]]:
        return self._run(store.stats())

    def due(self) -> dict[str, tuple[int, float]]:
        """Per name: pending tasks due now, and the age in seconds of the oldest due one (the
        server's clock; for autoscaling)."""
        from mtask.store.depth import due

        return self._run(due())

    def cancel(self, key: str) -> Task:
        return Task.from_document(self._run(store.cancel(key, self.now())))

    def retry(self, key: str) -> Task:
        return Task.from_document(self._run(store.retry(key, self.now())))

    def workers(self, within_s: float = 10.0) -> builtins.list[dict[str, Any]]:
        """Workers that sent a heartbeat in the last ``within_s`` seconds."""
        return self._run(control.live_workers(self.now(), dt.timedelta(seconds=within_s)))

    def stop_worker(self, worker_id: str) -> bool:
        """Ask a worker to drain and exit; False if no such worker is registered."""
        return self._run(control.request_stop(worker_id))

    def pause(self, name: str) -> None:
        """Stop claiming of ``name`` on every worker (runs in flight finish)."""
        self._run(control.set_paused(validate_name(name), True, self.now()))

    def resume(self, name: str) -> None:
        self._run(control.set_paused(validate_name(name), False, self.now()))

    def paused(self) -> set[str]:
        """The task names paused on every worker."""
        return self._run(control.paused_names())

    def set_limit(
        self,
        name: str,
        *,
        concurrency: int | None = None,
        rate: float | None = None,
        burst: int | None = None,
    ) -> dict[str, Any]:
        """Limit ``name`` across all workers: at most ``concurrency`` runs at once, at most
        ``rate`` claims per second (bursts of ``burst``). Applies within a second."""
        return self._run(limits.set_limit(name, concurrency, rate, burst, self.now()))

    def clear_limit(self, name: str) -> bool:
        return self._run(limits.clear_limit(validate_name(name)))

    def limits(self) -> builtins.list[dict[str, Any]]:
        return self._run(limits.all_limits())

    def set_retention(
        self,
        name: str,
        *,
        succeeded_ms: int | None = None,
        failed_ms: int | None = None,
        cancelled_ms: int | None = None,
    ) -> dict[str, Any]:
        """How long finished tasks of ``name`` (``"*"``: of every name) are kept, per status,
        in ms (-1: forever; ``None``: the next level's default). Applies to tasks published
        afterwards (it is written into each task's options at publish)."""
        return self._run(retention.set_defaults(name, succeeded_ms, failed_ms, cancelled_ms))

    def clear_retention(self, name: str) -> bool:
        return self._run(retention.clear_defaults(name))

    def retention(self) -> builtins.list[dict[str, Any]]:
        """The retention defaults set, per name (``"*"``: every name)."""
        return self._run(retention.all_defaults())

    def purge(
        self,
        *,
        name: str | None = None,
        status: Sequence[str] | None = None,
        older_than: dt.timedelta | None = None,
        keys: Sequence[str] | None = None,
        dry_run: bool = False,
    ) -> int:
        """Remove finished tasks (never an open one) matching the filters: ``status`` among
        succeeded, failed, cancelled (the default) and invalid, finished at least
        ``older_than`` ago; returns how many were (``dry_run``: would be) removed."""
        filt = retention.purge_filter(
            self.now(), name=name, statuses=status, older_than=older_than, keys=keys
        )
        return self._run(retention.purge_count(filt) if dry_run else retention.purge(filt))

    def add_schedule(self, id: str, task: str, **definition: Any) -> dict[str, Any]:
        """Create or change a schedule: ``cron=`` or ``every=``, and ``timezone``, ``params``,
        ``options``, ``catch_up`` (see ``mtask.schedules.Schedule.build``)."""
        schedule = schedules.Schedule.build(id, task, **definition)
        return self._run(schedules.put(schedule, self.now()))

    def schedules(self) -> builtins.list[dict[str, Any]]:
        return self._run(schedules.all_schedules())

    def pause_schedule(self, id: str) -> dict[str, Any]:
        return self._run(schedules.set_paused(id, True, self.now()))

    def resume_schedule(self, id: str) -> dict[str, Any]:
        return self._run(schedules.set_paused(id, False, self.now()))

    def remove_schedule(self, id: str) -> bool:
        return self._run(schedules.remove(id))

    def close(self) -> None:
        if self._owns_client:
            self.mongo.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- many tasks at once (mtask.store.bulk): the dashboard's list, search and bulk actions --

    def bulk(
        self, action: bulk.Action, where: bulk.Filter, *, dry_run: bool = False
    ) -> bulk.BulkResult:
        """Retry, cancel or purge the tasks ``where`` matches (a dry run only counts them)."""
        return self._run(bulk.apply(action, where, self.now(), dry_run))

    def search(self, **filters: Any) -> builtins.list[Task]:
        """A page of tasks by name, status, key ``prefix``, error ``text``, ``after``, ``limit``."""
        if filters.get("text") and not getattr(self, "_bulk_ready", False):
            self.ensure_bulk_indexes()  # error-text search needs its text index
        return [Task.from_document(d) for d in self._run(bulk.search(**filters))]

    def ensure_bulk_indexes(self) -> None:
        """The task list's, search's and throughput's own indexes (``mtask serve`` makes them)."""
        self._run(bulk.ensure_indexes())
        self._run(throughput.ensure_indexes())
        self._bulk_ready = True

    def record_throughput(self) -> int:
        return self._run(throughput.record(self.now()))

    def throughput(self, minutes: int = 60) -> builtins.list[dict[str, Any]]:
        return self._run(throughput.recent(self.now(), minutes))

    def runs_by_worker(self, minutes: int = 60) -> dict[str, dict[str, int]]:
        return self._run(throughput.runs_by_worker(self.now(), minutes))


class AsyncTaskClient(_Base):
    """asyncio client on pymongo's native ``AsyncMongoClient``."""

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
    ) -> None:
        super().__init__(database, collection, clock, max_params_bytes, registry)
        self._owns_client = mongo_client is None
        self.mongo: AsyncMongoClient[dict[str, Any]] = mongo_client or async_client(uri)
        self.db = self.mongo[database]
        self.collection = self.db[collection]
        self._driver = driver.AsyncDriver(driver.collections(self.db, collection))
        self._waiter: events.AsyncWaiter | None = None

    async def _run(
        self, op: driver.Op[driver.T], session: AsyncClientSession | None = None
    ) -> driver.T:
        if not self._ready:  # never in the caller's transaction
            await self._driver.run(store.ensure_indexes())
            self._ready = True
        if session is None:
            return await self._driver.run(op)
        return await self._driver.run(op, session)

    async def ensure_indexes(self) -> None:
        """Create the collection's indexes now (see ``TaskClient.ensure_indexes``)."""
        await self._run(store.get(""))

    async def now(self) -> dt.datetime:
        """The server's current time."""
        if self._server_clock is not None and not self._server_clock.calibrated:
            await self._server_clock.calibrate_async(self.db)
        return self.clock.now()

    async def publish(
        self,
        name: str,
        key: str,
        params: Any = None,
        *,
        options: TaskOptions | Mapping[str, Any] | None = None,
        delay: dt.timedelta | float | None = None,
        on_conflict: OnConflict = "ignore",
        depends_on: Sequence[str] | None = None,
        session: AsyncClientSession | None = None,
    ) -> PublishResult:
        """Publish one task (idempotent by key). With ``session``, every write joins it (and
        its transaction): its dependency bookkeeping too."""
        _check_on_conflict(on_conflict)
        _check_session(session, self.mongo)
        now = await self.now()
        if self.registry is not None:  # handler defaults (issue 18)
            options = self.registry.options_for(name, options)
        task = build_task(
            name,
            key,
            params,
            options,
            delay=delay,
            now=now,
            max_params_bytes=self.max_params_bytes,
            depends_on=depends_on,
        )
        with tracing.publish_span(task.name, task.key) as trace:
            published = await self._run(store.publish(task, now, on_conflict, trace=trace), session)
        _count_created({task.name: 1} if published.created else {}, session)
        if task.depends_on:
            await self._run(flows.after_publish([task], now), session)
            doc = await self._run(store.get(task.key), session)
            if doc is not None:
                published = store.Published(published.created, published.updated, doc)
        return _result(published)

    async def publish_many(
        self, items: Iterable[Mapping[str, Any]], *, session: AsyncClientSession | None = None
    ) -> int:
        """Insert-if-absent many tasks (see ``TaskClient.publish_many``)."""
        _check_session(session, self.mongo)
        now = await self.now()
        tasks = build_many(items, now, self.max_params_bytes)
        by_name: dict[str, int] = {}
        with tracing.publish_span(None, None, count=len(tasks)) as trace:
            created = await self._run(
                store.publish_many(tasks, now, created_by_name=by_name, trace=trace), session
            )
        _count_created(by_name, session)
        await self._run(flows.after_publish(tasks, now), session)
        return created

    async def wait(self, key: str, timeout: float | None = None) -> Task:  # noqa: ASYNC109
        """Wait until the task is finished and return it (see ``TaskClient.wait``)."""
        doc = await self._run(store.get(key))  # fails fast: no such key, finished, MongoDB away
        if doc is None:
            raise TaskNotFound(key)
        if not events.finished(doc):
            if self._waiter is None:
                self._waiter = events.AsyncWaiter(self.collection)
            doc = await self._waiter.wait(key, timeout)
        return Task.from_document(doc)

    def events(
        self,
        names: Iterable[str] | None = None,
        statuses: Iterable[str] | None = None,
        resume_after: str | None = None,
    ) -> AsyncIterator[events.TaskEvent]:
        """Task state changes across the cluster, for ever, resuming after a lost connection;
        pass an event's ``token`` as ``resume_after`` to continue after it (see
        ``mtask.events``)."""
        return events.events(self.collection, names, statuses, resume_after)

    async def flow(self, key: str) -> dict[str, Any] | None:
        """The tree of steps below ``key`` (see ``TaskClient.flow``)."""
        return await self._run(flows.tree(key))

    async def init_collection(self, validator: bool | None = None) -> dict[str, Any]:
        """See ``TaskClient.init_collection``."""
        return await self._run(store.collection_init(self.collection_name, validator))

    async def get(self, key: str) -> Task | None:
        doc = await self._run(store.get(key))
        return Task.from_document(doc) if doc is not None else None

    async def list(
        self,
        name: str | None = None,
        status: str | None = None,
        limit: int = 100,
        after: str | None = None,
        order: str = "newest",
    ) -> list[Task]:
        _check_list_args(status, limit, order)
        docs = await self._run(store.list_tasks(name, status, limit, after, order))
        return [Task.from_document(d) for d in docs]

    async def stats(self) -> dict[str, dict[str, int]]:
        return await self._run(store.stats())

    async def cancel(self, key: str) -> Task:
        return Task.from_document(await self._run(store.cancel(key, await self.now())))

    async def retry(self, key: str) -> Task:
        return Task.from_document(await self._run(store.retry(key, await self.now())))

    async def workers(self, within_s: float = 10.0) -> builtins.list[dict[str, Any]]:
        """Workers that sent a heartbeat in the last ``within_s`` seconds."""
        now = await self.now()
        return await self._run(control.live_workers(now, dt.timedelta(seconds=within_s)))

    async def stop_worker(self, worker_id: str) -> bool:
        """Ask a worker to drain and exit; False if no such worker is registered."""
        return await self._run(control.request_stop(worker_id))

    async def pause(self, name: str) -> None:
        """Stop claiming of ``name`` on every worker (runs in flight finish)."""
        await self._run(control.set_paused(validate_name(name), True, await self.now()))

    async def resume(self, name: str) -> None:
        await self._run(control.set_paused(validate_name(name), False, await self.now()))

    async def paused(self) -> set[str]:
        """The task names paused on every worker."""
        return await self._run(control.paused_names())

    async def set_limit(
        self,
        name: str,
        *,
        concurrency: int | None = None,
        rate: float | None = None,
        burst: int | None = None,
    ) -> dict[str, Any]:
        """Limit ``name`` across all workers (see ``TaskClient.set_limit``)."""
        return await self._run(limits.set_limit(name, concurrency, rate, burst, await self.now()))

    async def clear_limit(self, name: str) -> bool:
        return await self._run(limits.clear_limit(validate_name(name)))

    async def limits(self) -> builtins.list[dict[str, Any]]:
        return await self._run(limits.all_limits())

    async def set_retention(
        self,
        name: str,
        *,
        succeeded_ms: int | None = None,
        failed_ms: int | None = None,
        cancelled_ms: int | None = None,
    ) -> dict[str, Any]:
        """See ``TaskClient.set_retention``."""
        return await self._run(retention.set_defaults(name, succeeded_ms, failed_ms, cancelled_ms))

    async def clear_retention(self, name: str) -> bool:
        return await self._run(retention.clear_defaults(name))

    async def retention(self) -> builtins.list[dict[str, Any]]:
        return await self._run(retention.all_defaults())

    async def purge(
        self,
        *,
        name: str | None = None,
        status: Sequence[str] | None = None,
        older_than: dt.timedelta | None = None,
        keys: Sequence[str] | None = None,
        dry_run: bool = False,
    ) -> int:
        """See ``TaskClient.purge``."""
        filt = retention.purge_filter(
            await self.now(), name=name, statuses=status, older_than=older_than, keys=keys
        )
        return await self._run(retention.purge_count(filt) if dry_run else retention.purge(filt))

    async def add_schedule(self, id: str, task: str, **definition: Any) -> dict[str, Any]:
        """Create or change a schedule (see ``TaskClient.add_schedule``)."""
        schedule = schedules.Schedule.build(id, task, **definition)
        return await self._run(schedules.put(schedule, await self.now()))

    async def schedules(self) -> builtins.list[dict[str, Any]]:
        return await self._run(schedules.all_schedules())

    async def pause_schedule(self, id: str) -> dict[str, Any]:
        return await self._run(schedules.set_paused(id, True, await self.now()))

    async def resume_schedule(self, id: str) -> dict[str, Any]:
        return await self._run(schedules.set_paused(id, False, await self.now()))

    async def remove_schedule(self, id: str) -> bool:
        return await self._run(schedules.remove(id))

    async def close(self) -> None:
        if self._owns_client:
            await self.mongo.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- many tasks at once (mtask.store.bulk): the dashboard's list, search and bulk actions --

    async def bulk(
        self, action: bulk.Action, where: bulk.Filter, *, dry_run: bool = False
    ) -> bulk.BulkResult:
        """Retry, cancel or purge the tasks ``where`` matches (a dry run only counts them)."""
        return await self._run(bulk.apply(action, where, await self.now(), dry_run))

    async def search(self, **filters: Any) -> builtins.list[Task]:
        """A page of tasks by name, status, key ``prefix``, error ``text``, ``after``, ``limit``."""
        if filters.get("text") and not getattr(self, "_bulk_ready", False):
            await self.ensure_bulk_indexes()  # error-text search needs its text index
        return [Task.from_document(d) for d in await self._run(bulk.search(**filters))]

    async def ensure_bulk_indexes(self) -> None:
        """The task list's, search's and throughput's own indexes (``mtask serve`` makes them)."""
        await self._run(bulk.ensure_indexes())
        await self._run(throughput.ensure_indexes())
        self._bulk_ready = True

    async def record_throughput(self) -> int:
        """Count the last minutes' finished and failed tasks per name into ``throughput``."""
        return await self._run(throughput.record(await self.now()))

    async def throughput(self, minutes: int = 60) -> builtins.list[dict[str, Any]]:
        return await self._run(throughput.recent(await self.now(), minutes))

    async def runs_by_worker(self, minutes: int = 60) -> dict[str, dict[str, int]]:
        """Runs each worker ended (processed, failed) in the last ``minutes`` minutes."""
        return await self._run(throughput.runs_by_worker(await self.now(), minutes))
