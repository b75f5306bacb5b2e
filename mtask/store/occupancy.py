"""How full each limit is: for every limited name, its runs at once in use out of its
maximum, the groups' locks its sequences hold, and per group its tasks open, running, due and
blocked, and its head (the task that runs next). ``mtask limits``, ``GET /limits?use=true`` and
the dashboard's limits page show it.

A task is **blocked** here by the rules ``mtask.explain.states.explain`` applies to one task,
counted for many: due but its name paused or without a live worker, or held by a handler's
``BackOff`` (the name, or its group); in a sequence, every due task
but the one that may take the lock (its holder if due, else the first in publish order if due and
no task holds it); in a group limited to N runs at once, the due tasks beyond the free places;
then the name's own limit, beyond its free places.

Reads only: the limits, one aggregation over each limited name's open tasks (their group,
status, claim time and place in line, sorted by place in line per group), the groups' slot
documents, the paused names and the live workers. It costs what the limited names' backlog
costs; the ``TOP_GROUPS`` largest groups of a name are returned (``more_groups`` says how many
more there are). A name's groups' overrides (``set_group_limit``) are read from its limit
document, every one whether or not its group has open tasks (``NameUse.overrides``).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mtask.driver import Call, Doc, Op, gather
from mtask.limits import measured
from mtask.limits import rules as limits
from mtask.limits.holds import held_until
from mtask.limits.rules import (
    GroupOverride,
    Limit,
    group_limit,
    group_limit_for,
    group_slot,
    is_sequence,
    limit_under,
    own_limit,
)
from mtask.store import controls as control
from mtask.store import limits as store_limits
from mtask.store.cluster import LIVE, declared_uses
from mtask.store.schema import GROUP_LOCK, OPEN_LIST

TOP_GROUPS = 100
SHOWN_OVERRIDES = 50
"""The groups' overrides of a name that ``mtask limits`` and the limits page list (the first in
group order, ``NameUse.shown_overrides``; they say how many more): a name may have
``limits.MAX_OVERRIDES``."""


@dataclass(frozen=True)
class GroupUse:
    """One group of a limited name (``group`` ``None``: its tasks without a group)."""

    group: str | None
    open: int
    running: int
    due: int
    blocked: int
    in_use: int
    """Runs at once held: a sequence's lock (0 or 1), a group limit's live slot holders."""
    limit: int | None
    """Runs at once a group may have (``None``: no group limit)."""
    head: str | None
    """The task that runs next: a sequence's lock holder, else the first in publish order."""
    head_status: str | None
    holds_lock: bool = False
    weight: float = 1.0
    """Its share of turns (``set_group_limit(…, weight=…)``)."""
    overridden: bool = False
    """Whether it has an override of its own (``set_group_limit``): ``limit`` is the
    override's."""


@dataclass(frozen=True)
class NameUse:
    name: str
    limit: Mapping[str, Any]
    """The name's limit document."""
    paused: bool
    handled: bool
    """Whether a live worker handles the name."""
    in_use: int
    """The name's own runs at once in use (live holders of its slot)."""
    locks: int
    """Groups whose sequence lock a task holds."""
    open: int
    running: int
    due: int
    blocked: int
    groups: list[GroupUse] = field(default_factory=list)
    more_groups: int = 0
    users: tuple[str, ...] = ()
    """A shared resource's: the task names that take its slot (the live workers' handlers that
    declare it, and the names its document lists), in name order."""
    resource: bool = False
    """A shared resource's limit, ``name`` its name: its runs at once in use are
    those of every name whose handler uses it (its tasks are counted under those names)."""
    held_until: dt.datetime | None = None
    """Until when a handler's ``BackOff`` holds the name (or the resource) back, if it does."""
    held_groups: dict[str, dt.datetime] = field(default_factory=dict)
    """The groups a ``BackOff`` holds back, each until when."""
    token_window: measured.Window | None = None
    """A shared resource's limit in tokens and its current window's charge, if it has one."""

    @property
    def own(self) -> Limit:
        return own_limit(self.limit)

    @property
    def per_group(self) -> Limit:
        return group_limit(self.limit)

    @functools.cached_property
    def overrides(self) -> dict[str, GroupOverride]:
        """Every group's override (``set_group_limit``), in group order, whether or not the
        group has open tasks (``groups`` holds only those that have)."""
        return dict(sorted(limits.overrides(self.limit).items()))

    @property
    def shown_overrides(self) -> list[tuple[str, GroupOverride, Limit]]:
        """The first ``SHOWN_OVERRIDES`` of ``overrides``, each with the limit its group runs
        under (``limits.group_limit_for``: the override's fields over the name's group
        limit)."""
        shown = list(self.overrides.items())[:SHOWN_OVERRIDES]
        return [(g, o, limit_under(self.per_group, o)) for g, o in shown]

    @property
    def more_overrides(self) -> int:
        """The overrides beyond ``shown_overrides``."""
        return max(0, len(self.overrides) - SHOWN_OVERRIDES)


def _due(now: dt.datetime) -> Doc:
    """Whether an open task is due at ``now`` (an expression)."""
    return {
        "$and": [
            {"$eq": ["$status", "pending"]},
            {"$eq": [{"$type": "$next_claim_at"}, "date"]},
            {"$lte": ["$next_claim_at", now]},
        ]
    }


def _pipeline(name: str, now: dt.datetime) -> list[Doc]:
    due = _due(now)
    group = {"$cond": [{"$eq": [{"$type": "$options.group"}, "string"]}, "$options.group", None]}
    held = {"$cond": ["$lock", {"k": "$_id", "s": "$status", "d": "$due"}, None]}
    return [
        {"$match": {"name": {"$eq": name}, "status": {"$in": OPEN_LIST}}},
        {
            "$project": {
                "g": group,
                "status": 1,
                "publish_seq": 1,
                "due": due,
                "lock": {"$eq": [f"${GROUP_LOCK}", True]},
            }
        },
        {"$sort": {"g": 1, "publish_seq": 1, "_id": 1}},
        {
            "$group": {
                "_id": "$g",
                "open": {"$sum": 1},
                "running": {"$sum": {"$cond": [{"$eq": ["$status", "running"]}, 1, 0]}},
                "due": {"$sum": {"$cond": ["$due", 1, 0]}},
                "head": {"$first": "$_id"},
                "head_status": {"$first": "$status"},
                "head_due": {"$first": "$due"},
                "holder": {"$max": held},
            }
        },
        {"$sort": {"open": -1, "_id": 1}},
    ]


def _live(doc: Mapping[str, Any] | None, now: dt.datetime) -> int:
    """The units a slot document's holders whose lease has not ended take (one each unless a
    holder says ``units``)."""
    holders = (doc or {}).get("holders")
    return sum(
        _units_of(h)
        for h in (holders if isinstance(holders, list) else ())
        if isinstance(h, dict) and isinstance(h.get("expires"), dt.datetime) and h["expires"] > now
    )


def _units_of(holder: Mapping[str, Any]) -> int:
    units = holder.get("units")
    return units if isinstance(units, int) and not isinstance(units, bool) and units > 0 else 1


def _group_use(
    row: Doc, limit: Limit, slot: Mapping[str, Any] | None, now: dt.datetime
) -> GroupUse:
    """One group's use and blocked count (``row``: the aggregation's row of the group)."""
    group = row["_id"] if isinstance(row["_id"], str) else None
    holder = row.get("holder") if isinstance(row.get("holder"), dict) else None
    due = int(row.get("due") or 0)
    head, head_status = row.get("head"), row.get("head_status")
    if group is None or not limit.set:
        return GroupUse(
            group, row["open"], row["running"], due, 0, 0, None, _key(head), head_status
        )
    if is_sequence(limit):
        runnable = bool(holder["d"]) if holder else bool(row.get("head_due"))
        if holder is not None:
            head, head_status = holder.get("k"), holder.get("s")
        return GroupUse(
            group, row["open"], row["running"], due, due - int(runnable), int(holder is not None),
            1, _key(head), head_status, holds_lock=holder is not None,
        )  # fmt: skip
    in_use = _live(slot, now)
    room = due if limit.concurrency is None else max(0, limit.concurrency - in_use)
    return GroupUse(
        group, row["open"], row["running"], due, max(0, due - room), in_use, limit.concurrency,
        _key(head), head_status,
    )  # fmt: skip


def _key(value: Any) -> str | None:
    return None if value is None else str(value)


def _name_use(
    doc: Doc, rows: list[Doc], slots: Mapping[str, Doc], now: dt.datetime, facts: tuple[Any, Any]
) -> NameUse:
    paused, handled = facts
    name = str(doc["_id"])
    found = limits.overrides(doc)
    base = group_limit(doc)
    held_groups = _held_groups(doc, now)
    groups = []
    for r in rows:
        group = r["_id"] if isinstance(r["_id"], str) else None
        slot = slots.get(group_slot(name, str(group)))
        each = limit_under(base, None if group is None else found.get(group))
        use = _group_use(r, each, slot, now)
        if group in held_groups:  # a handler's BackOff holds the group: every due task waits
            use = dataclasses.replace(use, blocked=use.due)
        if group in found:
            weight = found[group].weight
            use = dataclasses.replace(
                use, weight=1.0 if weight is None else weight, overridden=found[group].limits
            )
        groups.append(use)
    due = sum(g.due for g in groups)
    blocked = sum(g.blocked for g in groups)
    own = own_limit(doc)
    in_use = _live(doc, now)
    held = held_until(doc, None, now)
    if paused or not handled or held is not None:  # a BackOff of the name holds every task
        blocked = due
    elif own.concurrency is not None:
        blocked += max(0, (due - blocked) - max(0, own.concurrency - in_use))
    return NameUse(
        name, doc, paused, handled, in_use, sum(1 for g in groups if g.holds_lock),
        sum(g.open for g in groups), sum(g.running for g in groups), due, blocked,
        groups[:TOP_GROUPS], max(0, len(groups) - TOP_GROUPS),
        held_until=held, held_groups=held_groups,
    )  # fmt: skip


def _held_groups(doc: Mapping[str, Any], now: dt.datetime) -> dict[str, dt.datetime]:
    holds = doc.get(limits.GROUP_HOLDS)
    return {
        h["group"]: h["until"]
        for h in (holds if isinstance(holds, list) else ())
        if isinstance(h, dict)
        and isinstance(h.get("group"), str)
        and isinstance(h.get("until"), dt.datetime)
        and h["until"] > now
    }


@dataclass(frozen=True)
class LimitGauge:
    """A limit's figures for the metrics (``metrics.LimitUse``): read from its document only."""

    limit: str
    """A task name, or ``resource:<name>`` for a shared resource."""
    in_use: int
    concurrency: int | None
    held: bool
    """A handler's BackOff holds the whole limit back now."""


def gauges(docs: Sequence[Doc], now: dt.datetime) -> list[LimitGauge]:
    """Each limit document's (``store_limits.all_limits``) figures at ``now``, any shape."""
    found = []
    for doc in docs:
        slot = doc.get("_id")
        if not isinstance(slot, str) or not slot:
            continue
        name = f"resource:{limits.resource_of(slot)}" if limits.is_resource(slot) else slot
        concurrency = own_limit(doc).concurrency
        found.append(
            LimitGauge(name, _live(doc, now), concurrency, held_until(doc, None, now) is not None)
        )
    return found


def use(now: dt.datetime, names: Sequence[str] | None = None) -> Op[list[NameUse]]:
    """Each limited name's use (of ``names`` only, if given), in name order."""
    found = yield from store_limits.all_limits()
    docs = _name_docs(found, names)
    shared = [d for d in found if limits.is_resource(str(d["_id"]))] if names is None else []
    if not docs and not shared:
        return []
    workers = yield from control.live_workers(now, LIVE, {"names": 1, "uses": 1})
    resources = yield from _resource_uses(shared, now, workers)
    if not docs:
        return resources
    paused = yield from control.paused_names()
    handled = {n for w in workers if isinstance(w.get("names"), list) for n in w["names"]}
    rows: list[list[Doc]] = list(
        (yield gather(*(Call("aggregate", (_pipeline(str(d["_id"]), now),)) for d in docs)))
    )
    slots = yield from _slots_of(_group_slot_ids(docs, rows))
    return [
        _name_use(d, found, slots, now, (str(d["_id"]) in paused, str(d["_id"]) in handled))
        for d, found in zip(docs, rows, strict=True)
    ] + resources


def _resource_uses(
    shared: Sequence[Doc], now: dt.datetime, workers: Sequence[Doc]
) -> Op[list[NameUse]]:
    """Each shared resource's use, in name order: its runs at once in use (every name's that
    takes its slot), those names, and their open, running, due and blocked tasks (blocked: due
    beyond its room, or all while a back-off holds it)."""
    taken = limits.resource_users(
        {n: sorted(s) for n, s in declared_uses(workers, None).items()},
        {str(d["_id"]): d for d in shared},
    )
    shared = sorted(shared, key=lambda d: str(d["_id"]))
    users = [tuple(sorted(n for n, slots in taken.items() if d["_id"] in slots)) for d in shared]
    asked = [u for u in users if u]  # a resource nobody takes has no tasks to count
    rows: list[list[Doc]] = list(
        (yield gather(*(Call("aggregate", (_users_pipeline(u, now),)) for u in asked)))
    )
    counted = dict(zip(asked, rows, strict=True))
    found = []
    for doc, names in zip(shared, users, strict=True):
        row = (counted.get(names) or [{}])[0]
        in_use, held = _live(doc, now), held_until(doc, None, now)
        due = int(row.get("due", 0))
        room = own_limit(doc).concurrency
        blocked = due if held else 0 if room is None else max(0, due - max(0, room - in_use))
        found.append(
            NameUse(
                limits.resource_of(str(doc["_id"])),
                doc,
                False,
                True,
                in_use,
                0,
                int(row.get("open", 0)),
                int(row.get("running", 0)),
                due,
                blocked,
                resource=True,
                held_until=held,
                users=names,
                token_window=measured.current(doc, now),
            )
        )
    return found


def _users_pipeline(names: Sequence[str], now: dt.datetime) -> list[Doc]:
    """The open, running and due tasks of ``names`` (a shared resource's users), one row."""
    running = {"$cond": [{"$eq": ["$status", "running"]}, 1, 0]}
    return [
        {"$match": {"name": {"$in": list(names)}, "status": {"$in": OPEN_LIST}}},
        {"$group": {"_id": None, "open": {"$sum": 1}, "running": {"$sum": running},
                    "due": {"$sum": {"$cond": [_due(now), 1, 0]}}}},
    ]  # fmt: skip


def _name_docs(found: Sequence[Doc], names: Sequence[str] | None) -> list[Doc]:
    """The limit documents of the names (of ``names`` only, if given), in name order."""
    return sorted(
        (
            d
            for d in found
            if not limits.is_resource(str(d["_id"])) and (names is None or d["_id"] in names)
        ),
        key=lambda d: str(d["_id"]),
    )


def _group_slot_ids(docs: Sequence[Doc], rows: Sequence[list[Doc]]) -> list[str]:
    """The slot documents of the groups shown (the ``TOP_GROUPS`` largest of each name) that
    a group limit other than a sequence's counts runs in."""
    return [
        group_slot(str(d["_id"]), str(r["_id"]))
        for d, found in zip(docs, rows, strict=True)
        for r in found[:TOP_GROUPS]
        if isinstance(r["_id"], str)
        and (each := group_limit_for(d, r["_id"])).set
        and not is_sequence(each)
    ]


def _slots_of(slot_ids: list[str]) -> Op[dict[str, Doc]]:
    """The slot documents ``slot_ids``, by id (no read if there are none)."""
    if not slot_ids:
        return {}
    found: list[Doc] = yield Call("find", ({"_id": {"$in": slot_ids}},), collection="limits")
    return {str(s["_id"]): s for s in found}
