"""The cluster's state that decides whether open tasks may run, read for ``mtask.explain.states``:
paused names, the live workers and the names they handle, the names' limits, and for the tasks'
limited groups a sequence's lock holder and first open task, another group limit's slot document,
and (for one task's page) how many open tasks of its sequence were published before it. Then the
derived states of many tasks: a page of one state (``search``), and the counts per name and
state (``counts``).

Reads only, each from an index or a small collection; nothing here is on a worker's path, and
nothing is written for the derived state.
"""

from __future__ import annotations

import datetime as dt
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mtask.driver import Call, Doc, Op, gather
from mtask.explain.states import (
    SHOWN_DEPENDENCIES,
    Cluster,
    Explained,
    Group,
    State,
    Worker,
    explain,
)
from mtask.limits.rules import (
    RESOURCE_IDS,
    RESOURCE_USERS,
    Limit,
    group_limit_for,
    group_slot,
    is_sequence,
    resource_slot,
    resource_users,
)
from mtask.store import bulk
from mtask.store import controls as control
from mtask.store.counts import Counts, stats
from mtask.store.schema import GROUP_LOCK, OPEN_LIST, SEQUENCE_LOCK
from mtask.vocabulary import OPEN_STATUSES, RunState, TaskStatus

if TYPE_CHECKING:
    from mtask.models import Task

LIVE = dt.timedelta(seconds=10)
"""A worker is live if its heartbeat is this recent (as ``client.workers``)."""
STATE_FIELDS: Doc = {
    "name": 1,
    "status": 1,
    "next_claim_at": 1,
    "available_at": 1,
    "waiting": 1,
    "waiting_on": 1,
    "failures": 1,
    "failed_permanently": 1,
    "attempts": 1,
    "options": 1,
    "publish_seq": 1,
    GROUP_LOCK: 1,
    "created_at": 1,
    "finished_at": 1,
    "invalid_reason": 1,
    "backoffs": 1,
    "runs": {"$slice": -3},
}
"""What ``explain`` reads of a task it counts or a sequence's lock holder (not its params,
result, error or steps)."""
SPLIT_UP_TO = 1_000
"""``counts`` derives the state of at most this many pending tasks per name (the newest); the
others are counted as pending, not split."""
EXAMINED_PAGES = 10
"""``search`` by a state reads at most this many pages of candidates per call."""


def _workers(docs: Iterable[Doc]) -> tuple[Worker, ...]:
    found = []
    for doc in docs:
        names = doc.get("names")
        host = doc.get("host")
        found.append(
            Worker(
                str(doc.get("_id")),
                host if isinstance(host, str) else None,
                frozenset(n for n in names if isinstance(n, str))
                if isinstance(names, list)
                else frozenset(),
            )
        )
    return tuple(found)


def read(tasks: Sequence[Task], now: dt.datetime, *, ahead: bool = False) -> Op[Cluster]:
    """What ``explain`` needs to know about ``tasks`` (``ahead``: also how many open tasks of
    each one's sequence are ahead of it, a count per task)."""
    paused = yield from control.paused_names()
    workers = yield from control.live_workers(now, LIVE, {"names": 1, "host": 1, "uses": 1})
    names = sorted({t.name for t in tasks if t.name is not None and _open(t)})
    limits: dict[str, Doc] = {}
    resources: dict[str, tuple[str, ...]] = {}
    if names:
        declared = declared_uses(workers, names)
        slots = sorted({s for found in declared.values() for s in found})
        listed = {**RESOURCE_IDS, RESOURCE_USERS: {"$in": names}}
        query = {"$or": [{"_id": {"$in": names + slots}}, listed]}
        docs = yield Call("find", (query,), collection="limits")
        limits = {str(d["_id"]): d for d in docs}
        resources = _resources(names, declared, limits)
    groups = yield from _groups(tasks, limits, ahead)
    missing = yield from _missing(tasks)
    return Cluster(
        now, frozenset(paused), _workers(workers), limits, groups, resources, frozenset(missing)
    )


def _missing(tasks: Sequence[Task]) -> Op[set[str]]:
    """The keys the pending ``tasks`` wait for (the first ``SHOWN_DEPENDENCIES`` of each, those
    a reason names) that no task has: a dependency never published, or purged."""
    awaited = {
        k
        for t in tasks
        if t.status is TaskStatus.PENDING
        for k in t.waiting_on[:SHOWN_DEPENDENCIES]
        if isinstance(k, str)
    }
    if not awaited:
        return set()
    found: list[Doc] = yield Call("find", ({"_id": {"$in": sorted(awaited)}}, {"_id": 1}))
    return awaited - {d["_id"] for d in found}


def declared_uses(workers: Iterable[Doc], names: Sequence[str] | None) -> dict[str, set[str]]:
    """The slots of the resources the live workers' handlers (of ``names`` only, if given)
    declare they use: their heartbeats' ``uses``, any shape."""
    wanted: set[str] | None = None if names is None else set(names)
    found: dict[str, set[str]] = {}
    for worker in workers:
        uses = worker.get("uses")
        for entry in uses if isinstance(uses, list) else ():
            name = entry.get("name") if isinstance(entry, Mapping) else None
            listed = entry.get("resources") if isinstance(entry, Mapping) else None
            if not isinstance(name, str) or (wanted is not None and name not in wanted):
                continue
            if isinstance(listed, list):
                found.setdefault(name, set()).update(
                    resource_slot(r) for r in listed if isinstance(r, str) and r
                )
    return found


def _resources(
    names: Sequence[str], declared: Mapping[str, set[str]], limits: Mapping[str, Doc]
) -> dict[str, tuple[str, ...]]:
    """The slots of the shared resources with a limit document each of ``names`` takes."""
    taken = resource_users({n: sorted(s) for n, s in declared.items()}, limits)
    return {
        name: found
        for name in names
        if (found := tuple(s for s in taken.get(name, ()) if s in limits))
    }


def _open(task: Task) -> bool:
    return task.status is None or not task.status.finished


def _pairs(tasks: Sequence[Task], limits: Mapping[str, Doc]) -> dict[tuple[str, str], Limit]:
    """The limited groups of the open ``tasks``, with their limit."""
    pairs: dict[tuple[str, str], Limit] = {}
    for task in tasks:
        group, name = task.options.group, task.name
        if group is None or name is None or name not in limits or not _open(task):
            continue
        limit = group_limit_for(limits[name], group)
        if limit.set:
            pairs[(name, group)] = limit
    return pairs


def _grouped(pairs: Iterable[tuple[str, str]]) -> Doc:
    """The open grouped tasks of ``pairs``' names and groups, as ``group_open`` spells it."""
    names = sorted({n for n, _ in pairs})
    groups = sorted({g for _, g in pairs})
    return {
        "status": {"$in": OPEN_LIST},
        "name": {"$in": names},
        "options.group": {"$type": "string", "$in": groups},
    }


def _groups(
    tasks: Sequence[Task], limits: Mapping[str, Doc], ahead: bool
) -> Op[dict[tuple[str, str], Group]]:
    from mtask.models import Task

    pairs = _pairs(tasks, limits)
    if not pairs:
        return {}
    sequences = [p for p, limit in pairs.items() if is_sequence(limit)]
    others = [p for p, limit in pairs.items() if not is_sequence(limit)]
    calls = []
    if sequences:
        match = _grouped(sequences)
        first = [
            {"$match": match},
            {"$sort": {"name": 1, "options.group": 1, "publish_seq": 1, "_id": 1}},
            {"$group": {"_id": {"n": "$name", "g": "$options.group"}, "key": {"$first": "$_id"}}},
        ]
        calls.append(Call("aggregate", (first,)))
        held = ({**match, GROUP_LOCK: True}, STATE_FIELDS)
        calls.append(Call("find", held, {"hint": SEQUENCE_LOCK}))
    if others:
        slots = [group_slot(n, g) for n, g in others]
        calls.append(Call("find", ({"_id": {"$in": slots}},), collection="limits"))
    results: list[Any] = list((yield gather(*calls)))
    firsts: dict[tuple[Any, Any], Any] = {}
    holders: dict[tuple[Any, Any], Task] = {}
    if sequences:
        firsts = {(d["_id"].get("n"), d["_id"].get("g")): d["key"] for d in results.pop(0)}
        for doc in results.pop(0):
            holder = Task.from_document(doc)
            holders[(holder.name, holder.options.group)] = holder
    slot_docs = {d["_id"]: d for d in results.pop(0)} if others else {}
    counted = (yield from _ahead(tasks, sequences)) if ahead else {}
    out: dict[tuple[str, str], Group] = {}
    for pair, limit in pairs.items():
        head = firsts.get(pair)
        out[pair] = Group(
            limit,
            holder=holders.get(pair),
            first=None if head is None else str(head),
            slot=slot_docs.get(group_slot(*pair)),
            ahead=counted.get(pair, {}),
        )
    return out


def _ahead(
    tasks: Sequence[Task], sequences: Sequence[tuple[str, str]]
) -> Op[dict[tuple[str, str], dict[str, int]]]:
    """For each open task of a sequence: the open tasks of its group published before it that
    do not hold its lock (a count of the ``group_open`` index's keys each)."""
    asked = [
        t
        for t in tasks
        if (t.name, t.options.group) in sequences and t.publish_seq is not None and _open(t)
    ]
    if not asked:
        return {}
    calls = []
    for task in asked:
        seq = task.publish_seq
        filt = {
            "name": task.name,
            "options.group": {"$eq": task.options.group, "$type": "string"},
            "status": {"$in": OPEN_LIST},
            "$or": [{"publish_seq": {"$lt": seq}}, {"publish_seq": seq, "_id": {"$lt": task.key}}],
            GROUP_LOCK: {"$ne": True},
        }
        calls.append(Call("count", (filt,), {"hint": "group_open"}))
    found = yield gather(*calls)
    out: dict[tuple[str, str], dict[str, int]] = {}
    for task, n in zip(asked, found, strict=True):
        assert task.name is not None and task.options.group is not None
        out.setdefault((task.name, task.options.group), {})[task.key] = int(n)
    return out


def explain_all(tasks: Sequence[Task], now: dt.datetime) -> Op[list[Explained]]:
    """The derived state of each of ``tasks`` (one read of the cluster for all of them)."""
    cluster = yield from read(tasks, now)
    return [explain(t, cluster) for t in tasks]


# -- a flow's tree ------------------------------------------------------------------------------


def explained_flow(key: str, now: dt.datetime) -> Op[Doc | None]:
    """The flow below ``key`` (``flows.tree``), each node with its derived ``state``, ``why``
    and ``reason``, as ``mtask get`` and the dashboard say them (one read of the cluster)."""
    from mtask.models import Task
    from mtask.store.flows import tree as flow_tree

    root = yield from flow_tree(key)
    if root is None:
        return None
    nodes, stack = {}, [root]
    while stack:
        node = stack.pop()
        nodes[node["key"]] = node
        stack.extend(node["children"])
    fields = {**STATE_FIELDS, "error": 1}  # a failed one says what it raised
    docs: list[Doc] = yield Call("find", ({"_id": {"$in": list(nodes)}}, fields))
    tasks = [Task.from_document(d) for d in docs]
    said = yield from explain_all(tasks, now)
    for task, e in zip(tasks, said, strict=True):
        nodes[task.key].update(state=e.state.value, why=e.why, reason=e.reason)
    return root


# -- a page of one state ------------------------------------------------------------------------


def candidates(state: State, now: dt.datetime) -> tuple[str, Doc]:
    """The stored status of the tasks that may be in ``state``, and a filter that every one of
    them matches (``explain`` then decides): a superset, so that no task of the state is
    missed, narrow enough that the server skips most of the others."""
    if not state.open:
        return state.value, {}
    if state is State.RUNNING:
        return TaskStatus.RUNNING.value, {}
    later = {"next_claim_at": {"$gt": now}, "waiting": {"$exists": False}}
    if state is State.SCHEDULED:
        return TaskStatus.PENDING.value, later
    if state is State.RETRYING:
        failed = [RunState.FAIL.value, RunState.TIMEOUT.value]
        tried = {"$or": [{"failures": {"$gt": 0}}, {"runs.state": {"$in": failed}}]}
        return TaskStatus.PENDING.value, {**later, **tried}
    if state is State.WAITING:
        waits = [
            {"waiting_on.0": {"$exists": True}},
            {"waiting": {"$exists": True}, "next_claim_at": {"$gt": now}},
        ]
        return TaskStatus.PENDING.value, {"$or": waits}
    due = [{"next_claim_at": {"$lte": now}}, {"next_claim_at": {"$not": {"$type": "date"}}}]
    return TaskStatus.PENDING.value, {"$or": due}


@dataclass(frozen=True)
class StatePage:
    """Tasks of one state, newest first, each with its explanation; ``after``: pass it back
    for the next page (``None``: no more), ``examined``: the candidates read."""

    tasks: list[tuple[Task, Explained]]
    after: str | None
    examined: int


def search(
    state: State,
    now: dt.datetime,
    *,
    name: str | None = None,
    group: str | None = None,
    prefix: str | None = None,
    text: str | None = None,
    after: str | None = None,
    limit: int = 50,
    parent: str | None = None,
) -> Op[StatePage]:
    """A page of tasks in ``state`` (and the other filters), newest first: the candidates
    (``candidates``) a page at a time, each explained, until ``limit`` are found or
    ``EXAMINED_PAGES`` pages were read; ``after`` is then the last key read."""
    from mtask.models import Task

    status, where = candidates(state, now)
    found: list[tuple[Task, Explained]] = []
    examined = 0
    more = True
    for _ in range(EXAMINED_PAGES):
        docs = yield from bulk.search(
            name, status, prefix, text, after, limit, group, where, parent
        )
        page = [Task.from_document(d) for d in docs]
        examined += len(page)
        said = yield from explain_all(page, now)
        found += [(t, e) for t, e in zip(page, said, strict=True) if e.state is state]
        more = len(docs) == limit
        after = page[-1].key if page else after
        if not more or len(found) >= limit:
            break
    if len(found) > limit:  # the next page starts after the last one shown
        return StatePage(found[:limit], found[limit - 1][0].key, examined)
    return StatePage(found, after if more else None, examined)


# -- counts per name and state ------------------------------------------------------------------


@dataclass(frozen=True)
class StateCounts:
    """``counts[name][state]``; ``unsplit[name]``: pending tasks beyond ``SPLIT_UP_TO`` whose
    state was not derived; ``stored``: the stored counts (finished ones bounded, their
    ``at_least``)."""

    counts: dict[str, dict[str, int]]
    unsplit: dict[str, int] = field(default_factory=dict)
    stored: Counts = field(default_factory=Counts)

    def show(self, name: str, state: str) -> str:
        if state in (State.SUCCEEDED, State.FAILED, State.CANCELLED, State.INVALID):
            shown: str = self.stored.show(name, state)
            return shown
        return f"{self.counts.get(name, {}).get(state, 0):,}"


def state_counts(
    now: dt.datetime,
    split_up_to: int = SPLIT_UP_TO,
    *,
    exact: bool = False,
    statuses: Sequence[str] | None = None,
) -> Op[StateCounts]:
    """Tasks per name and derived state: the stored counts (``counts.stats``: open ones
    exactly, finished ones up to a bound), the newest ``split_up_to`` pending tasks of each name
    read and explained. Costs what the backlog costs, at most ``split_up_to`` documents a
    name. ``exact``: the finished ones counted exactly (``counts.stats``); ``statuses``: count
    only the tasks of those stored statuses (``OPEN_STATUSES``: the open states alone)."""
    from mtask.models import Task

    stored = yield from stats(statuses, exact=exact)
    pending = [n for n, row in stored.items() if row.get(TaskStatus.PENDING.value)]
    calls = [
        Call(
            "find",
            ({"name": {"$eq": name}, "status": TaskStatus.PENDING.value}, STATE_FIELDS),
            {"sort": [("created_at", -1), ("_id", -1)], "limit": split_up_to},
        )
        for name in pending
    ]
    docs = list((yield gather(*calls))) if calls else []
    tasks = [Task.from_document(d) for found in docs for d in found]
    cluster = yield from read(tasks, now)
    split: dict[str, Counter[str]] = {}
    for task in tasks:
        split.setdefault(str(task.name), Counter())[explain(task, cluster).state.value] += 1
    out: dict[str, dict[str, int]] = {}
    unsplit: dict[str, int] = {}
    for name, row in stored.items():
        mine = {s: n for s, n in row.items() if s not in OPEN_STATUSES}
        mine.update(split.get(name, {}))
        if row.get(TaskStatus.RUNNING.value):
            mine[State.RUNNING.value] = row[TaskStatus.RUNNING.value]
        rest = row.get(TaskStatus.PENDING.value, 0) - sum(split.get(name, {}).values())
        if rest > 0:
            unsplit[name] = rest
        out[name] = mine
    return StateCounts(out, unsplit, stored)
