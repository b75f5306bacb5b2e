"""A client's publishing: a publish request validated and built (``build_task``,
``build_many``), then written with its handler's defaults, its retention and its encryption,
in the caller's session if it passes one (see ``mtask.client``)."""

from __future__ import annotations

import datetime as dt
import numbers
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from mtask import store
from mtask.client.aftercommit import after_commit
from mtask.client.checks import (
    check_debounce,
    check_on_conflict,
    check_session,
    check_supersede,
)
from mtask.client.core import Core, operation
from mtask.driver import Op
from mtask.errors import InvalidTask
from mtask.models import NewTask, PublishResult, Task, TaskOptions
from mtask.store import debounce as debounce_store
from mtask.store import flows as store_flows
from mtask.store import retention
from mtask.store import supersede as supersede_store
from mtask.vocabulary import DEFAULT_MAX_PARAMS_BYTES, OnConflict

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


def _count_created(by_name: Mapping[str, int], session: Any = None) -> None:
    """Count created tasks in ``mtask_published_total``: inside a transaction, once it has
    committed (an aborted one created nothing)."""

    def count() -> None:
        from mtask import metrics  # prometheus_client: not for a command that only reads

        for name, created in by_name.items():
            metrics.by_name(metrics.PUBLISHED, name).inc(created)

    if by_name:
        after_commit(session, count)


def _count_debounced(name: str, session: Any) -> None:
    """Count a publish that joined an open debounce window; inside a transaction,
    once it has committed."""
    from mtask import metrics

    after_commit(session, metrics.by_name(metrics.DEBOUNCED, name).inc)


def _count_superseded(name: str, kept: supersede_store.Superseding, session: Any) -> None:
    """Count what a publish's supersede policy did: the older tasks it cancelled, or
    the newer one dropped; inside a transaction, once it has committed."""
    if not (kept.superseded or kept.dropped):
        return
    from mtask import metrics

    if kept.superseded:
        cancelled = metrics.SUPERSEDED.labels(metrics.label(name), "cancelled")
        after_commit(session, lambda: cancelled.inc(len(kept.superseded)))
    if kept.dropped:
        after_commit(session, metrics.SUPERSEDED.labels(metrics.label(name), "dropped").inc)


def _result(published: store.Published) -> PublishResult:
    return PublishResult(
        created=published.created,
        updated=published.updated,
        task=Task.from_document(published.document),
    )


class Publishing:
    """The operations that put tasks in (``publish``, ``publish_many``), and the indexes they need
    made ahead of a transaction (``ensure_indexes``)."""

    def __init__(self, core: Core) -> None:
        self.core = core

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
        supersede: str | None = None,
        debounce: float | dt.timedelta | None = None,
        debounce_max: float | dt.timedelta | None = None,
    ) -> Op[PublishResult]:
        """Publish one task (idempotent by key). With ``session``, every write joins it (and
        its transaction): its dependency bookkeeping too. ``encrypt``: its params encrypted
        client-side (the client's ``encryption``; a name it lists is encrypted anyway).
        ``supersede``: ``drop_newer``, ``cancel_queued`` or ``cancel_running``, one open task
        of its name and group among those published with one (``mtask.store.supersede``).
        ``debounce`` (seconds): publishes of ``key`` within that long collapse into one run,
        that long after the last, at most ``debounce_max`` after the first; the last params
        win, and the task's key is ``<key>~<first publish>`` (``mtask.store.debounce``)."""
        check_on_conflict(on_conflict)
        check_session(session, self.core.mongo)
        policy = None
        if supersede is not None:
            policy = check_supersede(supersede, on_conflict, session, depends_on)
        quiet = None
        if debounce is not None or debounce_max is not None:
            quiet = check_debounce(debounce, debounce_max, on_conflict, session, depends_on)
            if delay is not None or policy is not None:
                raise InvalidTask("cannot be used with delay or supersede", field="debounce")
        now = self.core.clock.now()
        if self.core.registry is not None:  # handler defaults
            options = self.core.registry.options_for(name, options)
        task = build_task(
            name,
            key,
            params,
            options,
            delay=delay,
            now=now,
            max_params_bytes=self.core.max_params_bytes,
            depends_on=depends_on,
        )
        task = self._sealed(task, encrypt)
        from mtask import tracing  # OpenTelemetry's API if installed: a publisher's only

        known = yield from self._retention_defaults()
        with tracing.publish_span(task.name, task.key) as trace:
            if quiet is not None:
                window = yield from debounce_store.publish(task, quiet, now, trace, known)
                _count_created({task.name: 1} if window.created else {}, session)
                if not window.created:
                    _count_debounced(task.name, session)
                return _result(store.Published(window.created, not window.created, window.document))
            if policy is not None:
                kept = yield from supersede_store.publish_task(task, policy, now, trace, known)
                _count_created({task.name: 1} if kept.created else {}, session)
                _count_superseded(task.name, kept, session)
                published = store.Published(kept.created, False, kept.document)
                return _result(published).model_copy(
                    update={"superseded": kept.superseded, "dropped": kept.dropped}
                )
            published = yield from store.publish(  # in a session: one that cannot abort it
                task, now, on_conflict, trace=trace, retention=known, upsert=session is not None
            )
        _count_created({task.name: 1} if published.created else {}, session)
        if task.depends_on:
            yield from store_flows.after_publish([task], now)
            # its dependencies may have finished already
            doc = yield from store.get(task.key)
            if doc is not None:
                published = store.Published(published.created, published.updated, doc)
            missing = yield from store.missing_keys(task.depends_on)
            return _result(published).model_copy(update={"missing_dependencies": missing})
        return _result(published)

    @operation
    def publish_many(self, items: Iterable[Mapping[str, Any]], *, session: Any = None) -> Op[int]:
        """Insert-if-absent many tasks; returns how many were created. ``session``: as in
        ``publish``."""
        check_session(session, self.core.mongo)
        now = self.core.clock.now()
        tasks = [self._sealed(t, False) for t in build_many(items, now, self.core.max_params_bytes)]
        by_name: dict[str, int] = {}
        from mtask import tracing

        known = yield from self._retention_defaults()
        with tracing.publish_span(None, None, count=len(tasks)) as trace:
            created = yield from store.publish_many(
                tasks, now, created_by_name=by_name, trace=trace, retention=known
            )
        _count_created(by_name, session)
        yield from store_flows.after_publish(tasks, now)
        return created

    def _sealed(self, task: NewTask, asked: bool) -> NewTask:
        """``task`` with its params encrypted if it asks (or its name does)."""
        if self.core.encryption is None:
            if asked:
                raise InvalidTask(
                    "the client has no encryption: TaskClient(..., encryption=Encryption(...))",
                    field="encrypt",
                )
            return task
        if not self.core.encryption.wants(task.name, asked):
            return task
        return task.model_copy(update={"params": self.core.encryption.seal_params(task.params)})

    def _retention_defaults(self) -> Op[dict[str, Any]]:
        now = time.monotonic()
        known = self.core.retention_cache.get(now)
        if known is None:
            known = self.core.retention_cache.put((yield from retention.all_defaults()), now)
        return known

    @operation
    def ensure_indexes(self) -> Op[None]:
        """Create the collection's indexes now (done anyway on the first operation). Call it
        before a transaction that publishes: an index built during a transaction makes the
        transaction's snapshot unusable (a ``TransientTransactionError``)."""
        yield from store.get("")
