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
import functools
import numbers
import time
from collections.abc import (
    AsyncIterator,
    Callable,
    Coroutine,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from typing import TYPE_CHECKING, Any, Concatenate, Generic, ParamSpec, Self, TypeVar, overload

from pymongo import AsyncMongoClient, MongoClient
from pymongo.asynchronous.client_session import AsyncClientSession
from pymongo.errors import OperationFailure, PyMongoError
from pymongo.synchronous.client_session import ClientSession

from mtask import control, driver, events, flows, limits, schedules, store, streams
from mtask.aftercommit import after_commit
from mtask.clock import Clock, ServerClock
from mtask.connection import async_client, sync_client
from mtask.driver import Op
from mtask.errors import InvalidTask, TaskNotFound, TriggerNotFound
from mtask.models import (
    DEFAULT_MAX_PARAMS_BYTES,
    MAX_AGE_SECONDS,
    ON_CONFLICT_CHOICES,
    NewTask,
    OnConflict,
    PublishResult,
    Task,
    TaskOptions,
    TaskStatus,
    in_range,
    read_worker,
    validate_name,
)
from mtask.states import Explained, State, explain
from mtask.store import audit as store_audit
from mtask.store import (
    bulk,
    cluster,
    counts,
    followers,
    journal,
    occupancy,
    queries,
    retention,
    throughput,
)
from mtask.store import children as store_children
from mtask.store import output as store_output
from mtask.store import parked as store_parked
from mtask.store import steps as store_steps
from mtask.triggers import follower_of
from mtask.waiters import AsyncWaiter, SyncWaiter, async_waiter_for, finished, waiter_for

if TYPE_CHECKING:
    from mtask.encryption import Encryption
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
        seconds = delay_seconds(delay)
        if task.options.run_at is not None:
            raise InvalidTask("give either delay or options.run_at, not both", field="delay")
        assert now is not None
        run_at = now + dt.timedelta(seconds=seconds)
        task = task.model_copy(
            update={"options": task.options.model_copy(update={"run_at": run_at})}
        )
    return task


def delay_seconds(delay: object) -> float:
    """A publish's ``delay`` (seconds, or a timedelta) in seconds: 0 to ten years, else
    ``InvalidTask`` (a string, a bool, NaN or an int too large for a float included)."""
    if isinstance(delay, dt.timedelta):
        seconds: Any = delay.total_seconds()
    elif isinstance(delay, numbers.Real) and not isinstance(delay, bool):
        seconds = delay
    else:
        raise InvalidTask(
            f"must be a number of seconds or a timedelta, not {type(delay).__name__}",
            field="delay",
        )
    if not seconds >= 0:  # also NaN
        raise InvalidTask("must not be negative", field="delay")
    if seconds > MAX_DELAY_SECONDS:  # compared before float(): 10**400 has none
        raise InvalidTask("must be at most ten years", field="delay")
    return float(seconds)


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
    if on_conflict not in ON_CONFLICT_CHOICES:
        raise InvalidTask(
            f"must be ignore, update_params or reset, not {on_conflict!r}", field="on_conflict"
        )


def _check_kinds(kinds: Sequence[str] | None) -> None:
    unknown = sorted(set(kinds or ()) - set(store_output.KINDS))
    if unknown:
        raise InvalidTask(
            f"unknown output kind {unknown[0]!r}; one of {', '.join(store_output.KINDS)}",
            field="kinds",
        )


def _check_key(key: object, field: str = "key") -> None:
    """A key to look up is a string: a mapping, a regex or a number would be read as a query
    (``{"$gt": ""}`` matches whichever task comes first) or could never name a task."""
    if not isinstance(key, str):
        raise InvalidTask(f"must be a string, not {type(key).__name__}", field=field)


def _check_number(
    value: object, field: str, low: float, high: float, *, integer: bool = False
) -> None:
    """``value`` is a number from ``low`` to ``high`` (an int if ``integer``; never a bool or
    NaN): ``InvalidTask`` naming ``field`` otherwise, not a ``TypeError`` or an
    ``OverflowError`` from the date arithmetic it goes into."""
    if integer:
        ok = in_range(value, (int(low), int(high)))
    else:
        ok = isinstance(value, int | float) and not isinstance(value, bool) and low <= value <= high
    if not ok:
        kind = "an integer" if integer else "a number"
        raise InvalidTask(f"must be {kind} from {low:g} to {high:g}, not {value!r}", field=field)


def _check_list_args(status: str | None, limit: int, order: str) -> None:
    if status is not None and (
        not isinstance(status, str) or status not in {s.value for s in TaskStatus}
    ):
        raise InvalidTask(
            f"unknown status {status!r}; one of {', '.join(s.value for s in TaskStatus)}",
            field="status",
        )
    if not isinstance(limit, int) or isinstance(limit, bool) or not 1 <= limit <= 10_000:
        raise InvalidTask("must be an integer between 1 and 10000", field="limit")
    if not isinstance(order, str) or order not in store.LIST_ORDERS:
        raise InvalidTask(f"must be one of {', '.join(store.LIST_ORDERS)}", field="order")


def _count_created(by_name: Mapping[str, int], session: Any = None) -> None:
    """Count created tasks in ``mtask_published_total``: inside a transaction, once it has
    committed (an aborted one created nothing)."""

    def count() -> None:
        from mtask import metrics  # prometheus_client: not for a command that only reads

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


P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")


class operation(Generic[P, R]):
    """A client method written once, as an operation (an ``Op``: the ``Call``s it makes, see
    ``mtask.driver``). On a ``TaskClient`` it runs and returns its value; on an
    ``AsyncTaskClient`` it returns a coroutine of it. A ``session=`` keyword, where the method
    takes one, also goes to the driver: every write joins the caller's session."""

    def __init__(self, build: Callable[Concatenate[Any, P], Op[R]]) -> None:
        self.build = build
        self.__doc__ = build.__doc__
        self.__name__ = build.__name__

    @overload
    def __get__(self, client: None, owner: type[Any]) -> Self: ...

    @overload
    def __get__(self, client: TaskClient, owner: type[Any] | None = None) -> Callable[P, R]: ...

    @overload
    def __get__(
        self, client: AsyncTaskClient, owner: type[Any] | None = None
    ) -> Callable[P, Coroutine[Any, Any, R]]: ...

    def __get__(self, client: Any, owner: Any = None) -> Any:
        if client is None:
            return self
        build = self.build
        if isinstance(client, AsyncTaskClient):

            @functools.wraps(build)
            async def awaited(*args: P.args, **kwargs: P.kwargs) -> R:
                session: Any = kwargs.get("session")
                return await client._run(build(client, *args, **kwargs), session)

            return awaited

        @functools.wraps(build)
        def run(*args: P.args, **kwargs: P.kwargs) -> R:
            session: Any = kwargs.get("session")
            result: R = client._run(build(client, *args, **kwargs), session)
            return result

        return run


class _Base:
    """What both clients do, each method written once as an operation (``@operation``): the
    sync client runs it, the async client awaits it."""

    collection_name: str

    def __init__(
        self,
        database: str,
        collection: str,
        clock: Clock | None,
        max_params_bytes: int,
        registry: Registry | None = None,
        encryption: Encryption | None = None,
    ) -> None:
        self.registry = registry
        self.encryption = encryption
        """Encrypts the params of the publishes that ask (``mtask.encryption``) and decrypts
        what ``get`` reads (None: encrypted tasks read as they are stored)."""
        """Handlers whose declared option defaults complete this client's publishes."""
        self.collection_name = collection
        self.database_name = database
        self.max_params_bytes = max_params_bytes
        self.clock: Clock = clock or ServerClock()
        self._server_clock = self.clock if isinstance(self.clock, ServerClock) else None
        self._ready = False
        """The collection's indexes exist and the clock is calibrated (the first ``_run``)."""
        self._bulk_ready = False
        self._retention = retention.DefaultsCache()
        """The retention defaults, read at most every ``retention.CACHE_SECONDS``."""
        self.mongo: Any = None

    # -- publishing -----------------------------------------------------------------------------

    @operation
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
        session: Any = None,
        encrypt: bool = False,
    ) -> Op[PublishResult]:
        """Publish one task (idempotent by key). With ``session``, every write joins it (and
        its transaction): its dependency bookkeeping too. ``encrypt``: its params encrypted
        client-side (the client's ``encryption``; a name it lists is encrypted anyway)."""
        _check_on_conflict(on_conflict)
        _check_session(session, self.mongo)
        now = self.clock.now()
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
        task = self._sealed(task, encrypt)
        from mtask import tracing  # OpenTelemetry's API if installed: a publisher's only

        known = yield from self._retention_defaults()
        with tracing.publish_span(task.name, task.key) as trace:
            published = yield from store.publish(  # in a session: one that cannot abort it
                task, now, on_conflict, trace=trace, retention=known, upsert=session is not None
            )
        _count_created({task.name: 1} if published.created else {}, session)
        if task.depends_on:
            yield from flows.after_publish([task], now)
            # its dependencies may have finished already
            doc = yield from store.get(task.key)
            if doc is not None:
                published = store.Published(published.created, published.updated, doc)
        return _result(published)

    @operation
    def publish_many(self, items: Iterable[Mapping[str, Any]], *, session: Any = None) -> Op[int]:
        """Insert-if-absent many tasks; returns how many were created. ``session``: as in
        ``publish``."""
        _check_session(session, self.mongo)
        now = self.clock.now()
        tasks = [self._sealed(t, False) for t in build_many(items, now, self.max_params_bytes)]
        by_name: dict[str, int] = {}
        from mtask import tracing

        known = yield from self._retention_defaults()
        with tracing.publish_span(None, None, count=len(tasks)) as trace:
            created = yield from store.publish_many(
                tasks, now, created_by_name=by_name, trace=trace, retention=known
            )
        _count_created(by_name, session)
        yield from flows.after_publish(tasks, now)
        return created

    def _sealed(self, task: NewTask, asked: bool) -> NewTask:
        """``task`` with its params encrypted if it asks (or its name does)."""
        if self.encryption is None:
            if asked:
                raise InvalidTask(
                    "the client has no encryption: TaskClient(..., encryption=Encryption(...))",
                    field="encrypt",
                )
            return task
        if not self.encryption.wants(task.name, asked):
            return task
        return task.model_copy(update={"params": self.encryption.seal_params(task.params)})

    def _opened(self, doc: dict[str, Any]) -> dict[str, Any]:
        """A task document with its encrypted params and result decrypted, if this client has
        the key."""
        if self.encryption is None:
            return doc
        opened = {**doc, "params": self.encryption.open(doc.get("params"))}
        if "result" in doc:
            opened["result"] = self.encryption.open(doc["result"])
        return opened

    def _retention_defaults(self) -> Op[dict[str, Any]]:
        now = time.monotonic()
        known = self._retention.get(now)
        if known is None:
            known = self._retention.put((yield from retention.all_defaults()), now)
        return known

    @operation
    def ensure_indexes(self) -> Op[None]:
        """Create the collection's indexes now (done anyway on the first operation). Call it
        before a transaction that publishes: an index built during a transaction makes the
        transaction's snapshot unusable (a ``TransientTransactionError``)."""
        yield from store.get("")

    @operation
    def init_collection(
        self, validator: bool | None = None, operator_indexes: bool | None = None
    ) -> Op[dict[str, Any]]:
        """Create the tasks collection and its indexes; ``validator=True`` installs the task
        document's ``$jsonSchema`` validator (``mtask.jsonschema``), ``False`` removes any;
        ``operator_indexes`` likewise makes or drops ``store.schema.OPERATOR_INDEXES``. Returns
        the collection's options as the server reports them."""
        return (yield from store.collection_init(self.collection_name, validator, operator_indexes))

    @operation
    def read_token(
        self,
        key: str | None = None,
        ttl: float = 600,
        *,
        name: str | None = None,
        group: str | None = None,
        children: bool = False,
        secret: bytes | str | None = None,
    ) -> Op[str]:
        """A signed token that lets its holder read one task (``key``; with ``children`` its
        children too), or every task of ``name`` and ``group``, its progress and its output
        stream over ``mtask serve``, and nothing else, for ``ttl`` seconds by the server's
        clock (``mtask.read_tokens``). Signed with ``secret``, else
        ``MTASK_READ_TOKEN_SECRET``: the one serve checks with; rotating it revokes them."""
        from mtask import read_tokens

        scope = read_tokens.scope_of(key, name, group, children)
        seconds = read_tokens.check_ttl(ttl)
        given = secret.encode() if isinstance(secret, str) else secret
        signing = given or read_tokens.secret_from_env()
        if not signing:
            raise InvalidTask(f"no secret: pass secret= or set {read_tokens.ENV}", field="secret")
        expires = self.clock.now() + dt.timedelta(seconds=seconds)
        return read_tokens.sign(signing, scope, expires)
        yield  # an operation without a call: the clock is calibrated by the client first

    @operation
    def create_roles(self) -> Op[list[str]]:
        """Create or update the MongoDB roles of every part (``mtask.roles``) in this
        database, for this tasks collection; returns their names."""
        from mtask import roles

        return (yield from roles.create_roles(self.database_name, self.collection_name))

    # -- reading and acting on tasks ------------------------------------------------------------

    @operation
    def get(self, key: str) -> Op[Task | None]:
        _check_key(key)
        doc = yield from store.get(key)
        return Task.from_document(self._opened(doc)) if doc is not None else None

    @operation
    def output(
        self, key: str, after: int = 0, kinds: Sequence[str] | None = None, limit: int = 1000
    ) -> Op[builtins.list[streams.Entry]]:
        """Task ``key``'s log lines and chunks after ``after`` (a ``seq``), oldest first, at
        most ``limit`` (1,000): what is stored now (``stream`` follows new ones too)."""
        _check_kinds(kinds)
        docs = yield from store_output.read(key, after, kinds, limit)
        return [streams.Entry.from_document(d) for d in docs]

    @operation
    def list(
        self,
        name: str | None = None,
        status: str | None = None,
        limit: int = 100,
        after: str | None = None,
        order: str = "newest",
        group: str | None = None,
    ) -> Op[builtins.list[Task]]:
        """A page of tasks (of ``name``, ``status``, ``group``), newest first or soonest
        claimable first; ``after``: the last key of the previous page."""
        _check_list_args(status, limit, order)
        if after is not None:
            _check_key(after, "after")
        docs = yield from store.list_tasks(name, status, limit, after, order, group)
        return [Task.from_document(d) for d in docs]

    @operation
    def stats(self, exact: bool = False, statuses: Sequence[str] | None = None) -> Op[store.Counts]:
        """``{name: {status: count}}`` at a cost that does not grow with the tasks kept: open
        tasks exactly; finished ones exactly up to 1,000 per name and status, above that as
        1,001 (the pairs in ``.at_least``: a lower bound). ``exact=True`` counts everything
        exactly, walking every index key (docs/scale.md, "Counts"). ``statuses``: count only
        those."""
        return (yield from store.stats(statuses, exact=exact))

    @operation
    def groups(self, name: str | None = None, top: int = 10) -> Op[builtins.list[dict[str, Any]]]:
        """The groups (``options.group``) with the most open tasks, of ``name`` or of every
        name, largest first: ``{name, group, open, running}`` (at most 100)."""
        _check_number(top, "top", 0, 10**9, integer=True)  # the store keeps it within 1 to 100
        names = None if name is None else [validate_name(name)]
        return (yield from store.largest(names, top))

    @operation
    def due(self) -> Op[dict[str, tuple[int, float]]]:
        """Per name: pending tasks due now, and the age in seconds of the oldest due one (the
        server's clock; for autoscaling)."""
        from mtask.store.depth import due

        return (yield from due())

    @operation
    def flow(self, key: str) -> Op[dict[str, Any] | None]:
        """The tree of steps below ``key``: each node's key, name, status and children."""
        return (yield from flows.tree(key))

    @operation
    def cancel(self, key: str) -> Op[Task]:
        """Cancel an open task; a task that spawned children (``ctx.spawn_and_wait``) cancels
        its open children too, and theirs."""
        _check_key(key)
        now = self.clock.now()
        doc = yield from store.cancel(key, now)
        if doc.get("spawned") is not None:  # issue 61: its children are not awaited any more
            yield from store_children.cancel_children(key, now)
        return Task.from_document(doc)

    @operation
    def retry(self, key: str, from_step: str | None = None) -> Op[Task]:
        """Run a failed or cancelled task again. ``from_step``: its durable steps before that
        one are kept and replayed, that one and the later ones run again (one update, fenced
        like ``reset_step``; ``InvalidTask`` for no such step)."""
        _check_key(key)
        if from_step is not None:
            return Task.from_document(
                (yield from journal.retry_from(key, from_step, self.clock.now()))
            )
        return Task.from_document((yield from store.retry(key, self.clock.now())))

    @operation
    def signal(self, key: str, name: str, payload: Any = None) -> Op[bool]:
        """Send signal ``name`` (with a BSON ``payload``) to an open task: its handler's
        ``ctx.wait_for(name)`` returns the payload, whether the wait began before or after
        (docs/steps.md). ``True`` if it woke the task (it was waiting for ``name``).
        ``InvalidTask`` for a bad name or payload, ``TaskNotFound``, ``InvalidTransition`` for
        a finished task."""
        _check_key(key)
        return (yield from store_steps.signal(key, name, payload))

    @operation
    def reset_step(self, key: str, step: str) -> Op[store_steps.Reset]:
        """Reset task ``key``'s durable steps to before step ``step``: it and every step after
        it are removed, and the next run calls them again (a removed wait takes the next
        signal of its name: the one it had taken is removed too); a pending task may run now,
        a failed or cancelled one runs again once retried. One update, fenced so that no run
        of the task is RUNNING (docs/web.md). ``InvalidTask`` for no such step,
        ``TaskNotFound``, ``InvalidTransition`` while the task runs or once it succeeded."""
        _check_key(key)
        return (yield from store_steps.reset(key, step))

    @operation
    def rename_step(self, key: str, step: str, to: str) -> Op[journal.Remarked]:
        """Rename durable step ``step`` of a parked task ``to``, so that a changed handler
        replays it under its new name. One update, fenced like ``reset_step``."""
        _check_key(key)
        return (yield from journal.remark(key, step, to))

    @operation
    def drop_step(self, key: str, step: str) -> Op[journal.Remarked]:
        """Drop durable step ``step`` from a parked task's journal (a changed handler no longer
        asks for it): the later steps move up one place. One update, fenced like
        ``reset_step``; a pending task that waited in it runs now."""
        _check_key(key)
        return (yield from journal.remark(key, step, None))

    @operation
    def parked(
        self, name: str, after: tuple[Any, Any] | None = None
    ) -> Op[builtins.list[dict[str, Any]]]:
        """A page of ``name``'s parked tasks (pending, with durable steps), newest first, after
        the ``(created_at, _id)`` of the previous page's last, with the fields a preflight's dry
        replay reads (``mtask.preflight``). Reads only."""
        return (yield from store_parked.parked(name, after))

    # -- derived states (mtask.states) ----------------------------------------------------------

    @operation
    def explain(self, task: Task) -> Op[Explained]:
        """``task``'s derived state and why it is not running, with the cluster's state read
        now (for a task of a sequence, also how many of its group are ahead of it)."""
        now = self.clock.now()
        facts = yield from cluster.read([task], now, ahead=True)
        return explain(task, facts)

    @operation
    def explain_all(self, tasks: Sequence[Task]) -> Op[builtins.list[Explained]]:
        """The derived state of each of ``tasks``, the cluster read once for all."""
        return (yield from cluster.explain_all(tasks, self.clock.now()))

    @operation
    def search_state(self, state: str, /, **filters: Any) -> Op[cluster.StatePage]:
        """A page of tasks in derived ``state`` (``mtask.states.STATES``), newest first, with
        the filters of ``search`` (``name``, ``group``, ``prefix``, ``text``, ``after``,
        ``limit``); its ``after`` continues it."""
        try:
            wanted = State(state)
        except ValueError:
            raise InvalidTask(
                f"{state!r} is not a state ({', '.join(s.value for s in State)})", field="state"
            ) from None
        if filters.get("after") is not None:
            _check_key(filters["after"], "after")
        return (yield from cluster.search(wanted, self.clock.now(), **filters))

    @operation
    def state_counts(self) -> Op[cluster.StateCounts]:
        """Tasks per name and derived state (``store.cluster.state_counts``)."""
        return (yield from cluster.state_counts(self.clock.now()))

    # -- workers and names ----------------------------------------------------------------------

    @operation
    def workers(self, within_s: float = 10.0) -> Op[builtins.list[dict[str, Any]]]:
        """Workers that sent a heartbeat in the last ``within_s`` seconds, each document as
        ``models.read_worker`` reads it (any shape: fields in another shape are named in its
        ``problems``)."""
        _check_number(within_s, "within_s", 0, MAX_AGE_SECONDS)
        within = dt.timedelta(seconds=within_s)
        docs = yield from control.live_workers(self.clock.now(), within)
        return [read_worker(doc) for doc in docs]

    @operation
    def stop_worker(self, worker_id: str) -> Op[bool]:
        """Ask a worker to drain and exit; False if no such worker is registered."""
        return (yield from control.request_stop(worker_id))

    @operation
    def pause(self, name: str) -> Op[None]:
        """Stop claiming of ``name`` on every worker (runs in flight finish)."""
        yield from control.set_paused(validate_name(name), True, self.clock.now())

    @operation
    def resume(self, name: str) -> Op[None]:
        yield from control.set_paused(validate_name(name), False, self.clock.now())

    @operation
    def paused(self) -> Op[set[str]]:
        """The task names paused on every worker."""
        return (yield from control.paused_names())

    # -- limits and retention -------------------------------------------------------------------

    @operation
    def set_limit(
        self,
        name: str | None = None,
        *,
        resource: str | None = None,
        concurrency: int | None = None,
        rate: float | None = None,
        burst: int | None = None,
        group_concurrency: int | None = None,
        group_rate: float | None = None,
        group_burst: int | None = None,
        overflow: str | None = None,
    ) -> Op[dict[str, Any]]:
        """Limit ``name`` across all workers: at most ``concurrency`` runs at once, at most
        ``rate`` claims per second (bursts of ``burst``); and each of its groups
        (``options.group``) likewise with ``group_concurrency``, ``group_rate`` and
        ``group_burst`` (``group_concurrency=1``: each group is a sequence, run one at a time
        in publish order). Applies within a second.

        ``resource=`` instead of a name: the limit of a shared resource (an API quota), taken by
        every run of the names whose handler ``uses`` it (``@registry.task(uses=[...])``),
        exactly across the cluster; a resource has no groups.

        ``overflow``: what the limit does with a task it refuses: ``"queue"`` (the default: it
        waits for a slot), ``"drop"`` (cancelled at once) or ``"fail"`` (failed for good at
        once), its ``error`` saying why (a lossy limit)."""
        own = limits.Limit(concurrency, rate, burst)
        group = limits.Limit(group_concurrency, group_rate, group_burst)
        if resource is not None:
            if name is not None or group.set or group_burst is not None:
                raise InvalidTask(
                    "a resource's limit takes no name and no group_…", field="resource"
                )
            return (yield from limits.set_resource_limit(resource, own, self.clock.now(), overflow))
        return (
            yield from limits.set_limit(
                validate_name(name), own, group, self.clock.now(), overflow=overflow
            )
        )

    @operation
    def clear_limit(self, name: str | None = None, *, resource: str | None = None) -> Op[bool]:
        """Remove the limit of ``name`` (or of the shared resource ``resource``)."""
        if resource is not None:
            if name is not None:
                raise InvalidTask("give a name or a resource, not both", field="resource")
            return (yield from limits.clear_resource_limit(resource))
        return (yield from limits.clear_limit(validate_name(name)))

    @operation
    def set_group_limit(
        self,
        name: str,
        group: str,
        *,
        concurrency: int | None = None,
        rate: float | None = None,
        burst: int | None = None,
        weight: float | None = None,
    ) -> Op[dict[str, Any]]:
        """Override the group limit of one group of ``name`` (a tier, a tenant): its own
        ``concurrency``, ``rate`` and ``burst`` (``None``: the name's ``group_…`` value), and its
        ``weight``, its share of turns among the name's groups (3: three turns for every one of a
        group of weight 1). Replaces the group's override; applies within a second."""
        override = limits.GroupOverride(concurrency, rate, burst, weight)
        return (yield from limits.set_group_limit(name, group, override, self.clock.now()))

    @operation
    def clear_group_limit(self, name: str, group: str) -> Op[bool]:
        """Remove the override of ``group`` of ``name``: the name's group limit and weight 1."""
        return (yield from limits.clear_group_limit(name, group))

    @operation
    def limits(self) -> Op[builtins.list[dict[str, Any]]]:
        return (yield from limits.all_limits())

    @operation
    def limit_use(self) -> Op[builtins.list[occupancy.NameUse]]:
        """How full each limit is: runs at once in use, sequences' locks held, and per group
        its tasks open, running, due and blocked and the one that runs next
        (``store.occupancy``)."""
        return (yield from occupancy.use(self.clock.now()))

    @operation
    def set_retention(
        self,
        name: str,
        *,
        succeeded_ms: int | None = None,
        failed_ms: int | None = None,
        cancelled_ms: int | None = None,
    ) -> Op[dict[str, Any]]:
        """How long finished tasks of ``name`` (``"*"``: of every name) are kept, per status,
        in ms (-1: forever; ``None``: the next level's default). Applies to tasks published
        afterwards (it is written into each task's options at publish; other clients read
        the defaults again within ``retention.CACHE_SECONDS``)."""
        self._retention.clear()
        return (yield from retention.set_defaults(name, succeeded_ms, failed_ms, cancelled_ms))

    @operation
    def clear_retention(self, name: str) -> Op[bool]:
        self._retention.clear()
        return (yield from retention.clear_defaults(name))

    @operation
    def retention(self) -> Op[builtins.list[dict[str, Any]]]:
        """The retention defaults set, per name (``"*"``: every name)."""
        return (yield from retention.all_defaults())

    @operation
    def purge(
        self,
        *,
        name: str | None = None,
        status: Sequence[str] | None = None,
        older_than: dt.timedelta | None = None,
        keys: Sequence[str] | None = None,
        dry_run: bool = False,
    ) -> Op[int]:
        """Remove finished tasks (never an open one) matching the filters: ``status`` among
        succeeded, failed, cancelled (the default) and invalid, finished at least
        ``older_than`` ago; returns how many were (``dry_run``: would be) removed."""
        filt = retention.purge_filter(
            self.clock.now(), name=name, statuses=status, older_than=older_than, keys=keys
        )
        return (yield from (retention.purge_count(filt) if dry_run else retention.purge(filt)))

    # -- schedules ------------------------------------------------------------------------------

    @operation
    def add_schedule(self, /, id: str, task: str, **definition: Any) -> Op[dict[str, Any]]:
        """Create or change a schedule: ``cron=`` or ``every=``, and ``timezone``, ``params``,
        ``options``, ``catch_up`` (see ``mtask.schedules.Schedule.build``)."""
        schedule = schedules.Schedule.build(id, task, **definition)
        return (yield from schedules.put(schedule, self.clock.now()))

    @operation
    def schedules(self) -> Op[builtins.list[dict[str, Any]]]:
        return (yield from schedules.all_schedules())

    @operation
    def pause_schedule(self, id: str) -> Op[dict[str, Any]]:
        return (yield from schedules.set_paused(id, True, self.clock.now()))

    @operation
    def resume_schedule(self, id: str) -> Op[dict[str, Any]]:
        return (yield from schedules.set_paused(id, False, self.clock.now()))

    @operation
    def remove_schedule(self, id: str) -> Op[bool]:
        return (yield from schedules.remove(id))

    # -- triggers and waits on data (docs/triggers.md) -----------------------------------------

    @operation
    def triggers(self) -> Op[builtins.list[dict[str, Any]]]:
        """Every follower of this tasks collection, as ``store.followers`` reads it: the
        registry's triggers (``kind`` ``trigger``) and the collections tasks wait on (``wait``),
        each with its holder, position (``at``, ``through``), lag (``lag_ms``, on the server's
        clock), counts, scan and declaration (``spec``)."""
        return (yield from followers.list_followers(self.collection_name))

    @operation
    def pause_trigger(self, name: str) -> Op[dict[str, Any]]:
        """Stop following a trigger (``NAME``, or ``wait:COLLECTION``) until resumed: its
        holder stops within a renewal, and its position is kept."""
        return (yield from self._follower_set(name, followers.set_paused, True))

    @operation
    def resume_trigger(self, name: str) -> Op[dict[str, Any]]:
        """Follow a paused trigger again, from its position (history lost: a scan)."""
        return (yield from self._follower_set(name, followers.set_paused, False))

    @operation
    def reset_trigger(self, name: str, *, scan: bool = False) -> Op[dict[str, Any]]:
        """Forget a trigger's position: it follows from now, after a scan of the matching
        documents if ``scan``."""
        return (yield from self._follower_set(name, followers.reset, scan))

    def _follower_set(
        self, name: str, change: Callable[..., Op[Any]], value: bool
    ) -> Op[dict[str, Any]]:
        kind, bare = follower_of(name)
        done = yield from change(self.collection_name, kind, bare, value)
        if done is None:
            raise TriggerNotFound(name)
        found = yield from followers.get(self.collection_name, kind, bare)
        return found or {}

    # -- many tasks at once (mtask.store.bulk): the dashboard's list, search and bulk actions --

    @operation
    def bulk_count(self, action: bulk.Action, where: bulk.Filter, limit: int) -> Op[int]:
        """How many tasks ``bulk`` would act on, up to ``limit`` (``limit + 1``: more)."""
        _check_number(limit, "limit", 1, 10**9, integer=True)
        return (yield from bulk.count(action, where, self.clock.now(), limit))

    @operation
    def bulk(
        self, action: bulk.Action, where: bulk.Filter, *, dry_run: bool = False
    ) -> Op[bulk.BulkResult]:
        """Retry, cancel or purge the tasks ``where`` matches (a dry run only counts them)."""
        return (yield from bulk.apply(action, where, self.clock.now(), dry_run))

    @operation
    def names(self) -> Op[builtins.list[str]]:
        """The names of the tasks in the collection (an index's distinct scan)."""
        found = yield counts.names()
        return sorted(str(n) for n in found if n is not None)

    @operation
    def search(self, /, **filters: Any) -> Op[builtins.list[Task]]:
        """A page of tasks by name, status, ``group``, key ``prefix``, error ``text``,
        ``after``, ``limit``."""
        if filters.get("after") is not None:
            _check_key(filters["after"], "after")
        if filters.get("text") and not self._bulk_ready:
            yield from self._bulk_indexes()  # error-text search needs its text index
        return [Task.from_document(d) for d in (yield from bulk.search(**filters))]

    @operation
    def ensure_bulk_indexes(self) -> Op[None]:
        """The task list's, search's and throughput's own indexes (``mtask serve`` makes them)."""
        yield from self._bulk_indexes()

    def _bulk_indexes(self) -> Op[None]:
        """A role that may not create indexes (a viewer's) leaves them to an admin's."""
        try:
            yield from bulk.ensure_indexes()
            yield from throughput.ensure_indexes()
        except OperationFailure as exc:
            if exc.code != driver.UNAUTHORIZED:
                raise
        self._bulk_ready = True

    @operation
    def ensure_audit(self) -> Op[None]:
        """The audit's capped collection (``store.audit``; ``mtask serve`` makes it)."""
        yield from store_audit.ensure()

    @operation
    def record_audit(self, entry: Mapping[str, Any]) -> Op[None]:
        """One record of an action, at the server's time."""
        yield from store_audit.record({**entry, "at": self.clock.now()})

    @operation
    def audit(
        self, limit: int = 100, before: str | None = None
    ) -> Op[builtins.list[dict[str, Any]]]:
        """The newest audit records first (``before``: the last ``id`` of the previous page)."""
        _check_number(limit, "limit", 1, 1000, integer=True)
        return (yield from store_audit.recent(limit, before))

    @operation
    def record_throughput(self) -> Op[int]:
        return (yield from throughput.record(self.clock.now()))

    @operation
    def throughput(self, minutes: int = 60) -> Op[builtins.list[dict[str, Any]]]:
        _check_number(minutes, "minutes", 1, MAX_AGE_SECONDS // 60, integer=True)
        return (yield from throughput.recent(self.clock.now(), minutes))

    @operation
    def finished_since(self, since: dt.datetime) -> Op[dict[str, int]]:
        """Per name, the tasks that finished after ``since`` (a server time)."""
        return (yield from queries.finished_since(since))

    @operation
    def runs_by_worker(self, minutes: int = 60) -> Op[dict[str, dict[str, int]]]:
        _check_number(minutes, "minutes", 1, MAX_AGE_SECONDS // 60, integer=True)
        return (yield from throughput.runs_by_worker(self.clock.now(), minutes))


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
        encryption: Encryption | None = None,
    ) -> None:
        super().__init__(database, collection, clock, max_params_bytes, registry, encryption)
        self._owns_client = mongo_client is None
        self.mongo: MongoClient[dict[str, Any]] = mongo_client or sync_client(uri)
        self.db = self.mongo[database]
        self.collection = self.db[collection]
        self._driver = driver.SyncDriver(driver.collections(self.db, collection))
        self._waiter: SyncWaiter | None = None

    def _run(self, op: Op[T], session: ClientSession | None = None) -> T:
        if not self._ready:  # never in the caller's transaction
            self.now()
            self._driver.run(store.ensure_indexes())
            self._ready = True
        elif self._server_clock is not None and self._server_clock.due():
            self.now()  # calibrated again: a long-lived client follows the server's clock
        return self._driver.run(op) if session is None else self._driver.run(op, session)

    def now(self) -> dt.datetime:
        """The server's current time (the clock calibrated first, and again every
        ``clock.KEEP_BEST`` seconds: a long-lived client follows the server's clock)."""
        if self._server_clock is not None and self._server_clock.due():
            try:
                self._server_clock.calibrate(self.db)
            except PyMongoError as exc:
                raise driver.storage_error(exc) from exc
        return self.clock.now()

    def wait(self, key: str, timeout: float | None = None) -> Task:
        """Block until the task is finished (succeeded, failed, cancelled or invalid) and
        return it. Raises ``WaitTimeout`` after ``timeout`` seconds (None: no limit) and
        ``TaskNotFound`` if no task has that key. All waits through one MongoClient on one
        collection share one change stream (``mtask.waiters``), whichever client makes them."""
        _check_key(key)
        if timeout is not None:
            _check_number(timeout, "timeout", 0, MAX_AGE_SECONDS)
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
        """Task state changes across the cluster (see ``mtask.events``); ``progress``: the
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
        (none lost, none repeated; see ``mtask.streams``). Raises ``TaskNotFound``."""
        _check_kinds(kinds)
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


class AsyncTaskClient(_Base):
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
    ) -> None:
        super().__init__(database, collection, clock, max_params_bytes, registry, encryption)
        self._owns_client = mongo_client is None
        self.mongo: AsyncMongoClient[dict[str, Any]] = mongo_client or async_client(uri)
        self.db = self.mongo[database]
        self.collection = self.db[collection]
        self._driver = driver.AsyncDriver(driver.collections(self.db, collection))
        self._waiter: AsyncWaiter | None = None

    async def _run(self, op: Op[T], session: AsyncClientSession | None = None) -> T:
        if not self._ready:  # never in the caller's transaction
            await self.now()
            await self._driver.run(store.ensure_indexes())
            self._ready = True
        elif self._server_clock is not None and self._server_clock.due():
            await self.now()  # calibrated again: a long-lived client follows the server's clock
        if session is None:
            return await self._driver.run(op)
        return await self._driver.run(op, session)

    async def now(self) -> dt.datetime:
        """The server's current time (see ``TaskClient.now``)."""
        if self._server_clock is not None and self._server_clock.due():
            try:
                await self._server_clock.calibrate_async(self.db)
            except PyMongoError as exc:
                raise driver.storage_error(exc) from exc
        return self.clock.now()

    async def wait(self, key: str, timeout: float | None = None) -> Task:  # noqa: ASYNC109
        """Wait until the task is finished and return it (see ``TaskClient.wait``)."""
        _check_key(key)
        if timeout is not None:
            _check_number(timeout, "timeout", 0, MAX_AGE_SECONDS)
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
        ``mtask.events``); ``progress`` and ``steps`` as ``TaskClient.events``."""
        return events.events(
            self.collection, names, statuses, resume_after, progress=progress, steps=steps
        )

    def stream(
        self, key: str, after: int = 0, kinds: Sequence[str] | None = None
    ) -> AsyncIterator[streams.Entry]:
        """Task ``key``'s log lines and chunks after ``after``, then new ones until it is
        finished (see ``TaskClient.stream``)."""
        _check_kinds(kinds)
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
