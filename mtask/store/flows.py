"""Flows in MongoDB: the outboxes of finished tasks flushed (their next tasks published), the
dependents marked and resolved, and a flow's tree read (the rules, what a next step is and its
key, are mtask.flows)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from pymongo import UpdateOne

from mtask.driver import Call, Doc, Op
from mtask.flows import (
    FAILED_FOR_GOOD,
    MAX_TREE_NODES,
    RELEASABLE,
    clear_outbox,
    dependents_of,
    log,
    read_outbox,
)
from mtask.statemachine import recompute_stages
from mtask.vocabulary import TaskStatus

if TYPE_CHECKING:
    from mtask.models import NewTask


def flush_outboxes(
    parents: Sequence[str] | None, now: dt.datetime, older_than: dt.datetime | None = None
) -> Op[list[NewTask]]:
    """Publish the next steps waiting in the outboxes of ``parents`` (or of any task whose
    outbox is older than ``older_than``: the sweep), then clear those outboxes. An entry no
    step can be built from is logged and kept in the task's ``outbox_rejected`` with the
    reason (``read_outbox``), the others published: a malformed outbox neither stops the sweep
    nor is met by it again. Returns the steps, for the caller to resolve their dependencies."""
    from mtask import store  # store builds new documents; it does not import flows

    filt: Doc = {"outbox": {"$exists": True}}
    if parents is not None:
        filt["_id"] = {"$in": list(parents)}
    if older_than is not None:
        filt["updated_at"] = {"$lt": older_than}
    docs: list[Doc] = yield Call("find", (filt, {"outbox": 1}), {"limit": 1000})
    steps: list[NewTask] = []
    clears: list[UpdateOne] = []
    for doc in docs:
        found, rejected = read_outbox(doc["_id"], doc.get("outbox"))
        steps += found
        clears.append(clear_outbox(doc["_id"], doc.get("outbox"), rejected))
        if rejected:
            log.error(
                "next steps of task %r not published, kept in its outbox_rejected: %s",
                doc["_id"],
                "; ".join(r["reason"] for r in rejected),
            )
    if steps:
        yield from store.publish_many(steps, now)
    if clears:
        yield Call("bulk_write", (clears,), {"ordered": False})
    return steps


def mark_dependents(tasks: Iterable[NewTask]) -> Op[list[str]]:
    """Note on each dependency that it has dependents (its worker then resolves them as soon
    as it records the outcome). Returns the dependencies."""
    deps = sorted({d for t in tasks for d in t.depends_on})
    if deps:
        yield Call(
            "update_many",
            (
                {"_id": {"$in": deps}, "has_dependents": {"$ne": True}},
                {"$set": {"has_dependents": True}},
            ),
        )
    return deps


def after_publish(tasks: Sequence[NewTask], now: dt.datetime) -> Op[int]:
    """After tasks with dependencies were inserted: mark their dependencies, and resolve the
    ones that finished before the insert."""
    deps = yield from mark_dependents(tasks)
    changed: int = yield from resolve(deps, now)
    return changed


def resolve(keys: Sequence[str], now: dt.datetime) -> Op[int]:
    """Release the dependents of ``keys`` that succeeded; fail those of keys that failed for
    good. Returns how many dependents changed."""
    if not keys:
        return 0
    docs: list[Doc] = yield Call(
        "find",
        (
            {
                "_id": {"$in": list(keys)},
                "status": {"$in": [TaskStatus.SUCCEEDED.value, *FAILED_FOR_GOOD]},
            },
            {"status": 1},
        ),
    )
    succeeded = [d["_id"] for d in docs if d["status"] == TaskStatus.SUCCEEDED.value]
    changed = 0
    if succeeded:
        remaining = {"$setDifference": ["$waiting_on", succeeded]}
        result = yield Call(
            "update_many",
            (
                dependents_of(succeeded, RELEASABLE),
                [
                    {
                        "$set": {
                            "waiting_on": {
                                "$cond": [{"$eq": [{"$size": remaining}, 0]}, "$$REMOVE", remaining]
                            }
                        }
                    },
                    *recompute_stages(now),
                ],
            ),
        )
        changed += result.modified_count
    for doc in docs:
        if doc["status"] in FAILED_FOR_GOOD:
            result = yield Call(
                "update_many",
                (
                    dependents_of([doc["_id"]], [TaskStatus.PENDING.value]),
                    [
                        {
                            "$set": {
                                "failed_permanently": True,
                                "error": {
                                    "$literal": f"dependency {doc['_id']!r} is {doc['status']}"
                                },
                            }
                        },
                        *recompute_stages(now),
                    ],
                ),
            )
            changed += result.modified_count
    return changed


def awaited(limit: int = 1000) -> Op[list[str]]:
    """The dependencies that pending tasks still wait for (for the flow sweep)."""
    docs: list[Doc] = yield Call(
        "find",
        (
            {
                "waiting_on": {"$exists": True},
                "status": TaskStatus.PENDING.value,
                "$expr": {"$isArray": "$waiting_on"},  # another shape is the stranded search's
            },
            {"waiting_on": 1},
        ),
        {"limit": limit},
    )
    return sorted(
        {
            k
            for d in docs
            if isinstance(d.get("waiting_on"), list)
            for k in d["waiting_on"]
            if isinstance(k, str)
        }
    )


def tree(key: str) -> Op[Doc | None]:
    """The flow below ``key``: each node's key, name, status and children (at most
    ``MAX_TREE_NODES`` nodes)."""
    fields = {"name": 1, "status": 1, "parent": 1, "depends_on": 1, "waiting_on": 1}
    fields.update({"created_at": 1, "spawn.index": 1})  # the order below a node
    root: Doc | None = yield Call("find_one", ({"_id": key}, fields))
    if root is None:
        return None
    nodes = {key: _node(root)}
    order: dict[Any, tuple[Any, ...]] = {}
    frontier = [key]
    while frontier and len(nodes) < MAX_TREE_NODES:
        found: list[Doc] = yield Call(
            "find",
            ({"parent": {"$in": frontier}}, fields),
            {"sort": [("created_at", 1), ("_id", 1)], "limit": MAX_TREE_NODES},
        )
        frontier = []
        for doc in found:
            if doc["_id"] in nodes:
                continue
            nodes[doc["_id"]] = node = _node(doc)
            nodes[doc["parent"]]["children"].append(node)
            order[doc["_id"]] = place(doc)
            frontier.append(doc["_id"])
    for node in nodes.values():  # children as they were made: a spawn's by their place
        node["children"].sort(key=lambda child: order[child["key"]])
    return nodes[key]


def place(doc: Mapping[str, Any]) -> tuple[Any, ...]:
    """Where a task stands among its parent's: when it was made, then (a spawned child) its
    place in its spawn (``10`` after ``9``, as keys would not sort it), then its key."""
    spawn = doc.get("spawn")
    index = spawn.get("index") if isinstance(spawn, Mapping) else None
    made = doc.get("created_at")
    return (
        made.timestamp() if isinstance(made, dt.datetime) else 0.0,
        index if isinstance(index, int) else -1,
        str(doc["_id"]),
    )


def _node(doc: Mapping[str, Any]) -> Doc:
    node: Doc = {
        "key": doc["_id"],
        "name": doc.get("name"),
        "status": doc.get("status"),
        "children": [],
    }
    if doc.get("depends_on"):
        node["depends_on"] = doc["depends_on"]
        node["waiting_on"] = doc.get("waiting_on") or []
    return node
