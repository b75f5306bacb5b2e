"""A client's reads: a task, its output, pages and counts of tasks, their derived states
(``mtask.explain.states``), search; and the read tokens that let others read one."""

from __future__ import annotations

import builtins
import datetime as dt
from collections.abc import Sequence
from typing import Any

from pymongo.errors import OperationFailure

from mtask import driver, store
from mtask.client.checks import check_key, check_kinds, check_list_args, check_number
from mtask.client.core import Core, operation
from mtask.driver import Op
from mtask.errors import InvalidTask
from mtask.explain.states import Explained, State, explain
from mtask.follow import streams
from mtask.models import Task
from mtask.store import bulk, cluster, counts, throughput
from mtask.store import children as store_children
from mtask.store import output as store_output
from mtask.store import parked as store_parked
from mtask.vocabulary import validate_name


class Reading:
    """The operations that read tasks (``mtask.store``); none changes one."""

    def __init__(self, core: Core) -> None:
        self.core = core
        self._bulk_ready = False
        """The list's, search's and throughput's own indexes were made (``_bulk_indexes``)."""

    @operation
    def get(self, key: str) -> Op[Task | None]:
        check_key(key)
        doc = yield from store.get(key)
        return Task.from_document(self._opened(doc)) if doc is not None else None

    def _opened(self, doc: dict[str, Any]) -> dict[str, Any]:
        """A task document with its encrypted params and result decrypted, if this client has
        the key."""
        if self.core.encryption is None:
            return doc
        opened = {**doc, "params": self.core.encryption.open(doc.get("params"))}
        if "result" in doc:
            opened["result"] = self.core.encryption.open(doc["result"])
        return opened

    @operation
    def output(
        self, key: str, after: int = 0, kinds: Sequence[str] | None = None, limit: int = 1000
    ) -> Op[builtins.list[streams.Entry]]:
        """Task ``key``'s log lines and chunks after ``after`` (a ``seq``), oldest first, at
        most ``limit`` (1,000): what is stored now (``stream`` follows new ones too)."""
        check_kinds(kinds)
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
        check_list_args(status, limit, order)
        if after is not None:
            check_key(after, "after")
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
        check_number(top, "top", 0, 10**9, integer=True)  # the store keeps it within 1 to 100
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
        """The tree of steps below ``key``: each node's key, name, status, derived state (with
        ``why`` and ``reason``) and children."""
        return (yield from cluster.explained_flow(key, self.core.clock.now()))

    @operation
    def children(self, key: str, limit: int = 20) -> Op[tuple[builtins.list[Task], int]]:
        """The first ``limit`` tasks ``key`` made (its spawned children and next steps), as
        they were made (``store.children.first``), and how many it made in all
        (``search(parent=key)`` pages through them)."""
        check_key(key)
        check_number(limit, "limit", 1, 1000, integer=True)
        total = yield from store_children.count(key)
        docs = (yield from store_children.first(key, limit, total)) if total else []
        return [Task.from_document(self._opened(d)) for d in docs], total

    @operation
    def parked(
        self, name: str, after: tuple[Any, Any] | None = None
    ) -> Op[builtins.list[dict[str, Any]]]:
        """A page of ``name``'s parked tasks (pending, with durable steps), newest first, after
        the ``(created_at, _id)`` of the previous page's last, with the fields a preflight's dry
        replay reads (``mtask.steps.preflight``). Reads only."""
        return (yield from store_parked.parked(name, after))

    @operation
    def missing(self, keys: Sequence[str]) -> Op[builtins.list[str]]:
        """Which of ``keys`` no task has, in their order (a dependency to check before a
        publish that ``depends_on`` it)."""
        for key in keys:
            check_key(key, "keys")
        return (yield from store.missing_keys(keys))

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
            check_key(filters["after"], "after")
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
        clock (``mtask.security.read_tokens``). Signed with ``secret``, else
        ``MTASK_READ_TOKEN_SECRET``: the one serve checks with; rotating it revokes them."""
        from mtask.security import read_tokens

        scope = read_tokens.scope_of(key, name, group, children)
        seconds = read_tokens.check_ttl(ttl)
        given = secret.encode() if isinstance(secret, str) else secret
        signing = given or read_tokens.secret_from_env()
        if not signing:
            raise InvalidTask(f"no secret: pass secret= or set {read_tokens.ENV}", field="secret")
        expires = self.core.clock.now() + dt.timedelta(seconds=seconds)
        return read_tokens.sign(signing, scope, expires)
        yield  # an operation without a call: the clock is calibrated by the client first

    # -- derived states (mtask.explain.states) -----------------------------------------------------

    @operation
    def explain(self, task: Task) -> Op[Explained]:
        """``task``'s derived state and why it is not running, with the cluster's state read
        now (for a task of a sequence, also how many of its group are ahead of it)."""
        now = self.core.clock.now()
        facts = yield from cluster.read([task], now, ahead=True)
        return explain(task, facts)

    @operation
    def explain_all(self, tasks: Sequence[Task]) -> Op[builtins.list[Explained]]:
        """The derived state of each of ``tasks``, the cluster read once for all."""
        return (yield from cluster.explain_all(tasks, self.core.clock.now()))

    @operation
    def search_state(self, state: str, /, **filters: Any) -> Op[cluster.StatePage]:
        """A page of tasks in derived ``state`` (``mtask.explain.states.STATES``), newest first,
        with the filters of ``search`` (``name``, ``group``, ``prefix``, ``text``, ``after``,
        ``limit``); its ``after`` continues it."""
        try:
            wanted = State(state)
        except ValueError:
            raise InvalidTask(
                f"{state!r} is not a state ({', '.join(s.value for s in State)})", field="state"
            ) from None
        if filters.get("after") is not None:
            check_key(filters["after"], "after")
        return (yield from cluster.search(wanted, self.core.clock.now(), **filters))

    @operation
    def state_counts(
        self, *, exact: bool = False, statuses: Sequence[str] | None = None
    ) -> Op[cluster.StateCounts]:
        """Tasks per name and derived state (``store.cluster.state_counts``); ``exact``: the
        finished ones counted exactly, at a cost that grows with the collection; ``statuses``:
        only the tasks of those stored statuses."""
        now = self.core.clock.now()
        return (yield from cluster.state_counts(now, exact=exact, statuses=statuses))
