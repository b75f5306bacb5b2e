"""Groups of a name (``options.group``): the next task of each sequence, and the largest
groups, each read from the ``group_open`` index (open grouped tasks only, in publish order;
a sequence's lock holder from the ``group_lock`` index; a run its group's slot still holds
from the ``limits`` collection)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import Any

from mtask.driver import Call, Doc, Op, gather
from mtask.limits.rules import group_slot
from mtask.statemachine import RUNNING, live_run_expr
from mtask.store.schema import GROUP_LOCK, LOCK_STATUSES, OPEN_LIST, SEQUENCE_LOCK

MAX_TOP = 100
HEAD_FIELDS = {
    "name": 1,
    "options.group": 1,
    "options.worker_timeout_ms": 1,
    "status": 1,
    "next_claim_at": 1,
    "live": live_run_expr("$$NOW"),
}
"""What ``heads`` reads of a group's lock holder (``live``: a run of it still runs on a live
lease, by the server's clock)."""


def _open(names: Sequence[str] | None, groups: Sequence[str] | None = None) -> Doc:
    """Open grouped tasks of ``names`` (all names: ``None``) and ``groups``, as the index's
    filter spells it."""
    match: Doc = {"status": {"$in": OPEN_LIST}}
    if names is not None:
        match["name"] = {"$in": list(names)}
    match["options.group"] = {"$type": "string"}
    if groups is not None:
        match["options.group"]["$in"] = list(groups)
    return match


def heads(pairs: Sequence[tuple[str, str]]) -> Op[dict[tuple[str, str], Doc]]:
    """The next task of each ``(name, group)``, the only one of a sequence that may run: the
    open task that holds the group's lock (``group_lock``: it started and goes on first,
    whether it runs, waits for a retry, sleeps, or was left by a worker that died), else the
    first open task in publish order. Groups with no open task are absent; so are tasks whose
    key is not a string (no claim takes one: the sweep marks it invalid). Returns ``_id``,
    ``status``, ``next_claim_at`` and ``worker_timeout_ms`` of each.

    Two reads sent at once (``gather``): the first tasks through the ``group_open`` index, the
    holders through the ``group_lock`` index (one key per group at most)."""
    if not pairs:
        return {}
    match = _heads_match(pairs)
    firsts, holders = yield gather(_firsts(match), _lock_holders(match))
    holders = yield from _without_stale(holders)
    return _heads_of(pairs, firsts, holders)


def heads_and_slots(
    pairs: Sequence[tuple[str, str]], slotted: Sequence[tuple[str, str]], now: dt.datetime
) -> Op[dict[tuple[str, str], Doc]]:
    """``heads``, those of ``slotted`` marked ``slot_held`` if their group's slot document has
    a holder whose lease has not ended at ``now``: a run that holds no lock of the sequence,
    claimed while its group's limit was not one (``group_concurrency`` above 1, a rate) or
    counted in since its limit changed (``slots.join``); the sequence's next task waits for
    it. Only while its name's ``limits.SLOT_RUNS`` says such runs may be there: three reads
    sent at once, the third by ``_id`` in ``limits``."""
    if not pairs:
        return {}
    match = _heads_match(pairs)
    slots = sorted(group_slot(*pair) for pair in slotted)
    held: Doc = {"_id": {"$in": slots}, "holders": {"$elemMatch": {"expires": {"$gt": now}}}}
    firsts, holders, live = yield gather(
        _firsts(match),
        _lock_holders(match),
        Call("find", (held, {"_id": 1}), collection="limits"),
    )
    holders = yield from _without_stale(holders)
    out = _heads_of(pairs, firsts, holders)
    taken = {d["_id"] for d in live}
    for pair, head in out.items():
        if group_slot(*pair) in taken:
            head["slot_held"] = True
    return out


def _heads_match(pairs: Sequence[tuple[str, str]]) -> Doc:
    names = sorted({n for n, _ in pairs})
    groups = sorted({g for _, g in pairs})
    return {**_open(names, groups), "_id": {"$type": "string"}}


def _firsts(match: Doc) -> Call:
    """The first open task of each group in publish order."""
    return Call(
        "aggregate",
        (
            [
                {"$match": match},
                {"$sort": {"name": 1, "options.group": 1, "publish_seq": 1, "_id": 1}},
                {
                    "$group": {
                        "_id": {"name": "$name", "group": "$options.group"},
                        "key": {"$first": "$_id"},
                        "status": {"$first": "$status"},
                        "next_claim_at": {"$first": "$next_claim_at"},
                        "timeout": {"$first": "$options.worker_timeout_ms"},
                    }
                },
            ],
        ),
    )


def _lock_holders(match: Doc) -> Call:
    """The tasks that hold their group's lock (one a group at most): open ones, and cancelled
    ones that still do (whose run has not stopped yet, or whose worker died meanwhile)."""
    holders = {**match, "status": {"$in": LOCK_STATUSES}}
    return Call("find", ({**holders, GROUP_LOCK: True}, HEAD_FIELDS), {"hint": SEQUENCE_LOCK})


def lock_runs(pairs: Sequence[tuple[str, str]]) -> Call:
    """The runs of the tasks that hold the locks of ``pairs`` (``(name, group)``) that run on a
    live lease by the server's clock (``runs``: each ``run_id``, ``worker_id`` and
    ``lease_expires_at``), with ``name`` and ``options.group``: through the ``sequence_lock``
    index, one key per group at most."""
    match = {**_heads_match(pairs), "status": {"$in": LOCK_STATUSES}, GROUP_LOCK: True}
    runs = {
        "$map": {
            "input": {
                "$filter": {
                    "input": {"$cond": [{"$isArray": "$runs"}, "$runs", []]},
                    "as": "r",
                    "cond": {
                        "$and": [
                            {"$eq": ["$$r.state", RUNNING]},
                            {"$gt": ["$$r.lease_expires_at", "$$NOW"]},
                        ]
                    },
                }
            },
            "as": "r",
            "in": {
                "run_id": "$$r.run_id",
                "worker_id": "$$r.worker_id",
                "lease_expires_at": "$$r.lease_expires_at",
            },
        }
    }
    fields = {"name": 1, "options.group": 1, "runs": runs}
    return Call("find", (match, fields), {"hint": SEQUENCE_LOCK})


def _without_stale(holders: list[Doc]) -> Op[list[Doc]]:
    """``holders`` less the cancelled ones whose runs have all stopped: their lock is removed
    (one fenced update each: not open, and still no run on a live lease by the server's
    clock), and the group's first open task is its head. A cancelled holder whose run still
    runs stays the head, due never: the group waits for that run to stop."""
    kept: list[Doc] = []
    for doc in holders:
        if doc.get("status") in OPEN_LIST or doc.get("live") is True:
            kept.append(doc)
            continue
        stale = {
            "_id": doc["_id"],
            GROUP_LOCK: True,
            "status": {"$nin": OPEN_LIST},
            "$expr": {"$not": [live_run_expr("$$NOW")]},
        }
        result = yield Call("update_one", (stale, {"$unset": {GROUP_LOCK: ""}}))
        if not result.matched_count:  # reopened or run again meanwhile: it holds the lock
            kept.append({**doc, "status": "running", "next_claim_at": None})
    return kept


def _heads_of(
    pairs: Sequence[tuple[str, str]], firsts: list[Doc], holders: list[Doc]
) -> dict[tuple[str, str], Doc]:
    wanted = set(pairs)
    out: dict[tuple[str, str], Doc] = {}
    for doc in firsts:
        _head(out, wanted, doc["_id"], doc["key"], doc, doc.get("timeout"))
    for doc in holders:  # the holder goes first
        options = doc.get("options")
        if isinstance(options, dict):
            group = {"name": doc.get("name"), "group": options.get("group")}
            _head(out, wanted, group, doc["_id"], doc, options.get("worker_timeout_ms"))
    return out


def _head(
    out: dict[tuple[str, str], Doc],
    wanted: set[tuple[str, str]],
    group: Doc,
    key: Any,
    doc: Doc,
    timeout: Any,
) -> None:
    """``key`` is the head of ``group`` (``{name, group}``), if that is one of ``wanted``. An
    odd document (``options`` an array: its group is one too) names none of them."""
    name, of = group.get("name"), group.get("group")
    if isinstance(name, str) and isinstance(of, str) and (name, of) in wanted:
        out[(name, of)] = {
            "_id": key,
            "status": doc.get("status"),
            "next_claim_at": doc.get("next_claim_at"),
            "worker_timeout_ms": timeout,
        }


def largest(names: Sequence[str] | None = None, top: int = 10) -> Op[list[dict[str, Any]]]:
    """The groups of ``names`` (of every name: ``None``) with the most open tasks, largest
    first: ``{name, group, open, running}``. It reads the ``group_open`` index and the open
    grouped tasks: a cost that grows with the open grouped work, never with finished tasks."""
    top = max(1, min(top, MAX_TOP))
    docs: list[Doc] = yield Call(
        "aggregate",
        (
            [
                {"$match": _open(names)},
                {
                    "$group": {
                        "_id": {"name": "$name", "group": "$options.group"},
                        "open": {"$sum": 1},
                        "running": {"$sum": {"$cond": [{"$eq": ["$status", "running"]}, 1, 0]}},
                    }
                },
                {"$sort": {"open": -1, "_id.name": 1, "_id.group": 1}},
                {"$limit": top},
            ],
        ),
        {"hint": "group_open"},
    )
    return [
        {
            "name": d["_id"]["name"],
            "group": d["_id"]["group"],
            "open": d["open"],
            "running": d["running"],
        }
        for d in docs
    ]
