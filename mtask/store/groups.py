"""Groups of a name (``options.group``): the next task of each sequence, and the largest
groups, each read from the ``group_open`` index (open grouped tasks only, in publish order)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mtask.driver import Call, Doc, Op
from mtask.store.schema import OPEN_LIST

MAX_TOP = 100


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
    """The first open task, in publish order, of each ``(name, group)``: the only one of a
    sequence that may run. Groups with no open task are absent. Returns ``_id``, ``status``,
    ``next_claim_at`` and ``worker_timeout_ms`` of each."""
    if not pairs:
        return {}
    names = sorted({n for n, _ in pairs})
    groups = sorted({g for _, g in pairs})
    docs: list[Doc] = yield Call(
        "aggregate",
        (
            [
                {"$match": _open(names, groups)},
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
    wanted = set(pairs)
    out: dict[tuple[str, str], Doc] = {}
    for doc in docs:
        pair = (doc["_id"].get("name"), doc["_id"].get("group"))
        if pair in wanted:
            out[pair] = {
                "_id": doc["key"],
                "status": doc["status"],
                "next_claim_at": doc["next_claim_at"],
                "worker_timeout_ms": doc.get("timeout"),
            }
    return out


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
