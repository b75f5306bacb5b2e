"""The task document's shape: indexes, the fields a claim computes with (and how a
malformed document is recognised), the projections the worker reads, and new documents."""

from __future__ import annotations

import datetime as dt
from typing import Any

from pymongo import ASCENDING, DESCENDING, IndexModel

from mtask.driver import Call, Op
from mtask.models import NewTask, TaskStatus

Doc = dict[str, Any]


INDEXES: dict[str, list[IndexModel]] = {
    "tasks": [
        # Claims, scans and the safety sweep: open tasks only (finished ones have no
        # next_claim_at), so the index stays small however many finished tasks there are.
        IndexModel(
            [("name", ASCENDING), ("next_claim_at", ASCENDING), ("_id", ASCENDING)],
            name="claim",
            partialFilterExpression={"next_claim_at": {"$type": "date"}},
        ),
        IndexModel([("created_at", DESCENDING), ("_id", DESCENDING)], name="newest"),
        IndexModel(
            [("status", ASCENDING), ("created_at", DESCENDING), ("_id", DESCENDING)],
            name="status_newest",
        ),
        IndexModel(
            [
                ("name", ASCENDING),
                ("status", ASCENDING),
                ("created_at", DESCENDING),
                ("_id", DESCENDING),
            ],
            name="name_status_newest",
        ),
        # Flows: a task's steps, tasks waiting for dependencies, outboxes left by a crash.
        IndexModel(
            [("parent", ASCENDING), ("created_at", ASCENDING), ("_id", ASCENDING)],
            name="parent",
            partialFilterExpression={"parent": {"$exists": True}},
        ),
        IndexModel(
            [("waiting_on", ASCENDING)],
            name="waiting_on",
            partialFilterExpression={"waiting_on": {"$exists": True}},
        ),
        IndexModel(
            [("updated_at", ASCENDING)],
            name="outbox",
            partialFilterExpression={"outbox": {"$exists": True}},
        ),
    ],
    "workers": [IndexModel([("last_seen", ASCENDING)], name="last_seen")],
}

SPECIFIC = "options.specific_worker_ids"
WELL_FORMED: dict[str, Any] = {
    # The fields the claim's expressions compute with. A document inserted by hand without
    # them never matches a claim or a scan, so it cannot make a claim fail for its batch.
    "runs": {"$type": "array"},
    "successes": {"$type": "number"},
    "failures": {"$type": "number"},
    "attempts": {"$type": "number"},
    "available_at": {"$type": "date"},
    "options.concurrency": {"$type": "number"},
    "options.max_retries": {"$type": "number"},
    "options.worker_timeout_ms": {"$type": "number"},
    "options.ping_interval_ms": {"$type": "number"},
    SPECIFIC: {"$type": "array"},
}
KNOWN_STATUSES = [status.value for status in TaskStatus]


def well_formed_expr() -> Doc:
    """``WELL_FORMED`` (plus a string key and a known status) as an aggregation expression."""
    return {
        "$and": [
            {"$eq": [{"$type": "$_id"}, "string"]},
            {"$in": ["$status", KNOWN_STATUSES]},
            *(
                {"$in": [{"$type": f"${field}"}, _TYPE_ALIASES[spec["$type"]]]}
                for field, spec in WELL_FORMED.items()
            ),
        ]
    }


_TYPE_ALIASES = {
    "array": ["array"],
    "date": ["date"],
    "number": ["int", "long", "double", "decimal"],
}


def invalid_reason_expr() -> Doc:
    """Names the first field that makes a document malformed, and what it holds instead."""
    checks: list[tuple[Doc, str, str]] = [
        ({"$ne": [{"$type": "$_id"}, "string"]}, "_id", "a string"),
        ({"$not": [{"$in": ["$status", KNOWN_STATUSES]}]}, "status", "a known status"),
    ]
    checks += [
        (
            {"$not": [{"$in": [{"$type": f"${field}"}, _TYPE_ALIASES[spec["$type"]]]}]},
            field,
            f"a {spec['$type']}",
        )
        for field, spec in WELL_FORMED.items()
    ]
    found: dict[str, Doc] = {  # the unknown status itself, if it reads as a string
        "status": {
            "$convert": {
                "input": "$status",
                "to": "string",
                "onError": {"$type": "$status"},
                "onNull": "null",
            }
        }
    }
    branches = [
        {
            "case": test,
            "then": {
                "$concat": [
                    f"malformed task document: '{field}' must be {wanted}, found ",
                    found.get(field, {"$type": f"${field}"}),
                ]
            },
        }
        for test, field, wanted in checks
    ]
    return {"$switch": {"branches": branches, "default": "malformed task document"}}


CLAIMED_FIELDS = {"name": 1, "params": 1, "options": 1, "attempts": 1, "has_dependents": 1}
"""What a worker needs of a task it claimed."""
PLACEMENT_FIELDS = {
    "next_claim_at": 1,
    "name": 1,
    "options.priority": 1,
    "options.worker_timeout_ms": 1,
    SPECIFIC: 1,
}


LAST_WRITE = "last_write"
"""Set by a worker's claims and successes to ``claim:<worker id>`` / ``success:<worker id>``:
its own change stream skips these events (the worker knows what it wrote), so a draining
worker does not read back two events per task. Any other write leaves it alone, so its events
(a failure to retry, a release, a ping) reach every worker, the writer included."""


def claim_tag(worker_id: str) -> str:
    return f"claim:{worker_id}"


def success_tag(worker_id: str) -> str:
    return f"success:{worker_id}"


def literal(value: Any) -> dict[str, Any]:
    """Wrap user data placed in a pipeline so ``$``-strings are never read as expressions."""
    return {"$literal": value}


def new_document(task: NewTask, now: dt.datetime) -> Doc:
    available = task.options.run_at or now
    return {
        "_id": task.key,
        "name": task.name,
        "params": task.params,
        "options": task.options.to_document(),
        "status": TaskStatus.PENDING.value,
        "next_claim_at": available,
        "available_at": available,
        "attempts": 0,
        "successes": 0,
        "failures": 0,
        "failed_permanently": False,
        "runs": [],
        "runs_folded": 0,
        "result": None,
        "error": None,
        "created_at": now,
        "updated_at": now,
        "finished_at": None,
        **_flow_fields(task),
    }


def _flow_fields(task: NewTask) -> Doc:
    """A step's parent; dependencies, and the ones still awaited (none claimable before)."""
    fields: Doc = {}
    if task.parent is not None:
        fields["parent"] = task.parent
    if task.depends_on:
        fields["depends_on"] = list(task.depends_on)
        fields["waiting_on"] = list(task.depends_on)
        fields["next_claim_at"] = None
    return fields


# ---------------------------------------------------------------------------------------------
# Setup
# ---------------------------------------------------------------------------------------------


def ensure_indexes() -> Op[None]:
    for collection, models in INDEXES.items():
        yield Call("create_indexes", (models,), collection=collection)
