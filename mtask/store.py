"""Every MongoDB operation on tasks, each one atomic call, each taking ``now`` from a clock.

Each operation is a generator that yields one ``Call`` per MongoDB call and returns its result;
``mtask.driver`` runs it on the sync or the async client.

Fencing: every write that changes a run matches ``{"runs": {"$elemMatch": {"run_id": R,
"state": "RUNNING"}}}``, so a run whose lease was lost (taken over, released, cancelled) can
change nothing. Every transition ends with ``statemachine.recompute_stages(now)``.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from pymongo import ASCENDING, DESCENDING, IndexModel, ReturnDocument, UpdateOne
from pymongo.errors import DuplicateKeyError

from mtask.driver import Call, Op
from mtask.errors import InvalidTransition, TaskNotFound
from mtask.models import NewTask, OnConflict, RunState, TaskStatus
from mtask.statemachine import (
    OPEN,
    RUNNING,
    count_expired_expr,
    expire_leases_expr,
    live_runs_expr,
    recompute_stages,
    set_run_fields,
)

T = TypeVar("T")
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


def _well_formed_expr() -> Doc:
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


def _invalid_reason_expr() -> Doc:
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


def _lit(value: Any) -> dict[str, Any]:
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


# ---------------------------------------------------------------------------------------------
# Publishing
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Published:
    created: bool
    updated: bool
    document: Doc


def publish(task: NewTask, now: dt.datetime, on_conflict: OnConflict = "ignore") -> Op[Published]:
    """Insert the task if its key is new (one upsert with ``$setOnInsert``); otherwise apply
    ``on_conflict``: ``ignore`` leaves it, ``update_params`` replaces params and options of a
    task that is not running, ``reset`` makes a finished task new again."""
    doc = new_document(task, now)
    insert = {k: v for k, v in doc.items() if k != "_id"}
    before = None
    for attempt in range(2):
        try:
            before = yield Call(
                "find_one_and_update",
                ({"_id": task.key}, {"$setOnInsert": insert}),
                {"upsert": True, "return_document": ReturnDocument.BEFORE},
            )
            break
        except DuplicateKeyError:  # two upserts raced on a new key; the other one inserted
            if attempt:
                raise
    if before is None:
        return Published(created=True, updated=False, document=doc)
    if on_conflict == "ignore":
        return Published(created=False, updated=False, document=before)
    if on_conflict == "update_params":
        filt: Doc = {"_id": task.key, "status": {"$ne": TaskStatus.RUNNING.value}}
        sets: Doc = {"params": _lit(task.params), "options": _lit(task.options.to_document())}
        if task.options.run_at is not None:
            sets["available_at"] = task.options.run_at
        pipeline = [{"$set": sets}, *recompute_stages(now)]
    else:  # reset
        filt = {
            "_id": task.key,
            "status": {"$in": [s.value for s in TaskStatus if s.finished]},
            "runs": {"$not": {"$elemMatch": {"state": RUNNING, "lease_expires_at": {"$gt": now}}}},
        }
        fresh = {k: v for k, v in doc.items() if k not in ("_id", "created_at")}
        pipeline = [
            {
                "$replaceWith": {
                    "$mergeObjects": [{"_id": "$_id", "created_at": "$created_at"}, _lit(fresh)]
                }
            }
        ]
    after = yield Call(
        "find_one_and_update",
        (filt, pipeline),
        {"return_document": ReturnDocument.AFTER},
    )
    if after is None:
        current = yield Call("find_one", ({"_id": task.key},))
        return Published(created=False, updated=False, document=current or before)
    return Published(created=False, updated=True, document=after)


def publish_many(
    tasks: Sequence[NewTask],
    now: dt.datetime,
    batch_size: int = 1000,
    created_by_name: dict[str, int] | None = None,
) -> Op[int]:
    """Insert-if-absent many tasks with unordered bulk upserts; returns how many were created
    (and counts them per name into ``created_by_name``, if given)."""
    created = 0
    # a task that others of this batch depend on is born knowing it (so that the worker that
    # records its outcome resolves them, even if it claims it before anyone marks it)
    awaited = {d for task in tasks for d in task.depends_on}
    for start in range(0, len(tasks), batch_size):
        requests = []
        for task in tasks[start : start + batch_size]:
            doc = new_document(task, now)
            del doc["_id"]
            if task.key in awaited:
                doc["has_dependents"] = True
            requests.append(UpdateOne({"_id": task.key}, {"$setOnInsert": doc}, upsert=True))
        result = yield Call("bulk_write", (requests,), {"ordered": False})
        created += result.upserted_count
        if created_by_name is not None:
            for index in result.upserted_ids:
                name = tasks[start + index].name
                created_by_name[name] = created_by_name.get(name, 0) + 1
    return created


# ---------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------


def get(key: str) -> Op[Doc | None]:
    doc: Doc | None = yield Call("find_one", ({"_id": key},))
    return doc


def get_status(key: str) -> Op[Doc | None]:
    """The fields that say why a run lost its task."""
    doc: Doc | None = yield Call(
        "find_one", ({"_id": key}, {"status": 1, "runs.run_id": 1, "runs.state": 1, SPECIFIC: 1})
    )
    return doc


def placements(keys: Sequence[Any]) -> Op[list[Doc]]:
    """Claim-time fields of open tasks among ``keys`` (to re-place keys a claim did not get),
    each with ``well_formed``: whether a claim can match it at all."""
    docs: list[Doc] = yield Call(
        "find",
        (
            {"_id": {"$in": list(keys)}, "next_claim_at": {"$type": "date"}},
            {**PLACEMENT_FIELDS, "well_formed": _well_formed_expr()},
        ),
    )
    return docs


def quarantine(keys: Sequence[Any], now: dt.datetime, reason: str | None = None) -> Op[int]:
    """Mark open documents among ``keys`` that no claim can ever match (inserted by hand with
    missing or mistyped fields) ``invalid``, with the reason, and take them out of the claim
    index. Matches only documents that are still malformed, so a fixed one is left alone.
    With ``reason`` (a claim failed on the document itself), the open documents among
    ``keys`` whatever they hold."""
    filt: Doc = {"_id": {"$in": list(keys)}, "next_claim_at": {"$type": "date"}}
    if reason is None:
        filt["$expr"] = {"$not": [_well_formed_expr()]}
    result = yield Call(
        "update_many",
        (
            filt,
            [
                {
                    "$set": {
                        "invalid_reason": _invalid_reason_expr()
                        if reason is None
                        else _lit(reason),
                        "invalid_status": "$status",
                        "status": TaskStatus.INVALID.value,
                        "updated_at": now,
                    }
                },
                {"$unset": "next_claim_at"},
            ],
        ),
    )
    count: int = result.modified_count
    return count


LIST_ORDERS = ("newest", "next_claim_at")


def list_query(
    name: str | None, status: str | None, order: str = "newest"
) -> tuple[Doc, list[tuple[str, int]]]:
    filt: Doc = {}
    if name is not None:
        filt["name"] = name
    if status is not None:
        filt["status"] = status
    if order == "next_claim_at":
        filt["next_claim_at"] = {"$type": "date"}
        return filt, [("next_claim_at", ASCENDING), ("_id", ASCENDING)]
    return filt, [("created_at", DESCENDING), ("_id", DESCENDING)]


def list_tasks(
    name: str | None = None,
    status: str | None = None,
    limit: int = 100,
    after: str | None = None,
    order: str = "newest",
) -> Op[list[Doc]]:
    """A page of tasks, newest first (or soonest claimable first); ``after`` is the last key of
    the previous page."""
    filt, sort = list_query(name, status, order)
    if after is not None:
        field_name, direction = sort[0]
        anchor = yield Call("find_one", ({"_id": after}, {field_name: 1}))
        if anchor is None:
            raise TaskNotFound(after)
        op = "$gt" if direction == ASCENDING else "$lt"
        value = anchor.get(field_name)
        filt = {
            "$and": [
                filt,
                {"$or": [{field_name: {op: value}}, {field_name: value, "_id": {op: after}}]},
            ]
        }
    docs: list[Doc] = yield Call("find", (filt,), {"sort": sort, "limit": limit})
    return docs


def stats() -> Op[dict[str, dict[str, int]]]:
    """Counts per name and status, in one aggregation."""
    rows = yield Call(
        "aggregate",
        ([{"$group": {"_id": {"name": "$name", "status": "$status"}, "n": {"$sum": 1}}}],),
    )
    out: dict[str, dict[str, int]] = {}
    for row in rows:
        out.setdefault(str(row["_id"].get("name")), {})[str(row["_id"].get("status"))] = row["n"]
    return out


# ---------------------------------------------------------------------------------------------
# Operator actions
# ---------------------------------------------------------------------------------------------


def _require(key: str, doc: Doc | None, action: str, allowed: Iterable[str]) -> Op[Doc]:
    if doc is not None:
        return doc
    current = yield Call("find_one", ({"_id": key}, {"status": 1}))
    if current is None:
        raise TaskNotFound(key)
    raise InvalidTransition(
        f"cannot {action} task {key!r}: it is {current.get('status')}; "
        f"{action} applies to {' or '.join(allowed)} tasks"
    )


def cancel(key: str, now: dt.datetime) -> Op[Doc]:
    """pending or running -> cancelled at once. A running handler is stopped by its worker at
    the next ping (the ping matches only open tasks), and its run is then marked CANCELLED."""
    doc = yield Call(
        "find_one_and_update",
        (
            {"_id": key, "status": {"$in": list(OPEN)}},
            [{"$set": {"status": TaskStatus.CANCELLED.value}}, *recompute_stages(now)],
        ),
        {"return_document": ReturnDocument.AFTER},
    )
    result: Doc = yield from _require(key, doc, "cancel", OPEN)
    return result


def retry(key: str, now: dt.datetime) -> Op[Doc]:
    """failed or cancelled -> pending, with a fresh retry budget. Refused while a cancelled
    run's handler may still be stopping (a RUNNING run with a live lease)."""
    allowed = (TaskStatus.FAILED.value, TaskStatus.CANCELLED.value)
    filt = {
        "_id": key,
        "status": {"$in": list(allowed)},
        "runs": {"$not": {"$elemMatch": {"state": RUNNING, "lease_expires_at": {"$gt": now}}}},
    }
    pipeline = [
        {
            "$set": {
                "status": TaskStatus.PENDING.value,
                "failures": 0,
                "failed_permanently": False,
                "available_at": now,
                "error": None,
                "finished_at": None,
                "runs": {
                    "$map": {
                        "input": "$runs",
                        "as": "r",
                        "in": {
                            "$cond": [
                                {"$eq": ["$$r.state", RUNNING]},
                                {
                                    "$mergeObjects": [
                                        "$$r",
                                        {"state": "CANCELLED", "finished_at": now},
                                    ]
                                },
                                "$$r",
                            ]
                        },
                    }
                },
            }
        },
        *recompute_stages(now),
    ]
    doc = yield Call(
        "find_one_and_update", (filt, pipeline), {"return_document": ReturnDocument.AFTER}
    )
    if doc is None:
        current = yield Call("find_one", ({"_id": key}, {"status": 1}))
        if current is not None and current.get("status") in allowed:
            raise InvalidTransition(
                f"cannot retry task {key!r} yet: a cancelled run is still stopping; "
                "try again after its lease ends"
            )
    result: Doc = yield from _require(key, doc, "retry", allowed)
    return result


# ---------------------------------------------------------------------------------------------
# The worker's operations
# ---------------------------------------------------------------------------------------------


def claim_filter(
    keys: Sequence[str], names: Sequence[str], worker_id: str, now: dt.datetime
) -> Doc:
    """The claim filter, all of it decided on the server in one atomic update."""
    mine = {
        "$map": {
            "input": "$runs",
            "as": "r",
            "in": {
                "$and": [
                    {"$eq": ["$$r.worker_id", _lit(worker_id)]},
                    {
                        "$or": [
                            {"$eq": ["$$r.state", RunState.SUCCESS.value]},
                            {
                                "$and": [
                                    {"$eq": ["$$r.state", RUNNING]},
                                    {"$gt": ["$$r.lease_expires_at", now]},
                                ]
                            },
                        ]
                    },
                ]
            },
        }
    }
    return {
        "_id": {"$in": list(keys), "$type": "string"},
        "name": {"$in": list(names)},
        "status": {"$in": list(OPEN)},
        "next_claim_at": {"$type": "date", "$lte": now},
        "$or": [{SPECIFIC: {"$size": 0}}, {SPECIFIC: worker_id}],
        **WELL_FORMED,
        "$expr": {
            "$and": [
                # types first ($and stops at the first false): the server may evaluate this
                # before the type filters above, and must not fail on a malformed document
                {"$isArray": "$runs"},
                {"$isNumber": "$successes"},
                {"$isNumber": "$options.concurrency"},
                # a free slot: live runs + successes < concurrency
                {
                    "$lt": [
                        {"$add": [{"$size": live_runs_expr(now)}, "$successes"]},
                        "$options.concurrency",
                    ]
                },
                # with concurrency > 1, each run must be by a distinct worker
                {
                    "$or": [
                        {"$eq": ["$options.concurrency", 1]},
                        {"$not": [{"$anyElementTrue": [mine]}]},
                    ]
                },
            ]
        },
    }


def run_id_for(batch: str, key: str) -> str:
    """A run's id: unique across all runs, also within a batch claim (one batch, many keys)."""
    return f"{batch}-{key}"


def _new_run(run_id: Any, worker_id: Any, now: dt.datetime, lease: Any) -> Doc:
    """A RUNNING run as a claim appends it (values or expressions)."""
    return {
        "run_id": run_id,
        "worker_id": worker_id,
        "state": RUNNING,
        "claimed_at": now,
        "lease_expires_at": lease,
        "finished_at": None,
        "error": None,
        "result": None,
    }


def claim_pipeline(batch: str, worker_id: str, now: dt.datetime) -> list[Doc]:
    """Expire dead leases (each a failure), then append this worker's run if retries are left
    after that; then recompute status and next_claim_at. The run's id is ``run_id_for(batch,
    key)``, built on the server for each document of a batch."""
    new_run = _new_run(
        {"$concat": [_lit(f"{batch}-"), "$_id"]},
        _lit(worker_id),
        now,
        {"$add": [now, "$options.worker_timeout_ms"]},
    )
    return [
        {"$set": {"_expired": count_expired_expr(now)}},
        {
            "$set": {
                "runs": expire_leases_expr(now),
                "failures": {"$add": ["$failures", "$_expired"]},
            }
        },
        {"$set": {"_claim": {"$lte": ["$failures", "$options.max_retries"]}}},
        {
            "$set": {
                "runs": {"$cond": ["$_claim", {"$concatArrays": ["$runs", [new_run]]}, "$runs"]},
                "attempts": {"$add": ["$attempts", {"$cond": ["$_claim", 1, 0]}]},
                "error": {
                    "$cond": [
                        {"$gt": ["$_expired", 0]},
                        "lease expired: the worker stopped pinging",
                        "$error",
                    ]
                },
            }
        },
        {"$unset": ["_expired", "_claim"]},
        *recompute_stages(now),
    ]


def claim_fast_update(
    key: str, names: Sequence[str], worker_id: str, now: dt.datetime, run_id: str, timeout_ms: int
) -> tuple[Doc, Doc]:
    """The common claim as a plain update: a pending, concurrency-1 task whose lease length
    is ``timeout_ms``. Pending means no RUNNING run (so no lease to expire and the slot is
    free) and retries left; fewer than 20 runs means nothing to fold. So the pipeline's result
    is known in advance; the filter makes sure each of these holds."""
    lease = now + dt.timedelta(milliseconds=timeout_ms)
    filt = {
        **claim_lean_filter([key], names, worker_id, now),
        "options.worker_timeout_ms": timeout_ms,
    }
    update = {
        "$push": {"runs": _new_run(run_id, worker_id, now, lease)},
        "$inc": {"attempts": 1},
        "$set": {"status": TaskStatus.RUNNING.value, "next_claim_at": lease, "updated_at": now},
    }
    return filt, update


def claim_lean_filter(
    keys: Sequence[str], names: Sequence[str], worker_id: str, now: dt.datetime
) -> Doc:
    """The batch form of ``claim_fast_update``'s filter: pending concurrency-1 tasks with
    fewer than 20 runs, for which the claim pipeline's result is known in advance."""
    return {
        "_id": {"$in": list(keys), "$type": "string"},  # run ids are built from keys
        "name": {"$in": list(names)},
        "status": TaskStatus.PENDING.value,
        "next_claim_at": {"$type": "date", "$lte": now},
        "$or": [{SPECIFIC: {"$size": 0}}, {SPECIFIC: worker_id}],
        **WELL_FORMED,
        "options.concurrency": 1,
        "runs.19": {"$exists": False},
    }


def claim_lean_pipeline(batch: str, worker_id: str, now: dt.datetime) -> list[Doc]:
    """What ``claim_pipeline`` does to a document ``claim_lean_filter`` matches, in one stage:
    no lease to expire, a free slot, retries left, nothing to fold."""
    lease = {"$add": [now, "$options.worker_timeout_ms"]}
    new_run = _new_run({"$concat": [_lit(f"{batch}-"), "$_id"]}, _lit(worker_id), now, lease)
    return [
        {
            "$set": {
                "runs": {"$concatArrays": ["$runs", [new_run]]},
                "attempts": {"$add": ["$attempts", 1]},
                "status": TaskStatus.RUNNING.value,
                "next_claim_at": lease,
                "updated_at": now,
            }
        }
    ]


def claim(
    keys: Sequence[str],
    names: Sequence[str],
    worker_id: str,
    now: dt.datetime,
    timeouts: Mapping[str, int] | None = None,
    fields: Mapping[str, int] | None = None,
    batch: str | None = None,
    isolate: bool = False,
) -> Op[list[Doc]]:
    """Claim as many of ``keys`` as the server allows. Returns the claimed documents (only
    ``fields`` of them, if given); this worker's run is the one whose ``run_id`` is the
    ``claim_run_id`` added to each.

    One key: one ``find_one_and_update``; if ``timeouts`` gives its ``worker_timeout_ms`` as
    this worker last saw it, the plain-update shortcut (``claim_fast_update``) is tried first.
    Many keys (or one with ``isolate``, so that a document the server cannot update is
    reported as a write error): one pipeline ``update_many`` and one read of what was claimed
    (a batch shortcut of one plain update per key measured no faster, so there is none)."""
    if not keys:
        return []
    timeouts = timeouts or {}
    batch = batch or uuid.uuid4().hex
    if len(keys) == 1 and not isolate:
        key = keys[0]
        run_id = run_id_for(batch, key)
        options: dict[str, Any] = {"return_document": ReturnDocument.AFTER}
        if fields is not None:
            options["projection"] = {**fields, "runs.run_id": 1}
        doc = None
        if key in timeouts:
            doc = yield Call(
                "find_one_and_update",
                claim_fast_update(key, names, worker_id, now, run_id, timeouts[key]),
                options,
            )
        if doc is None:
            doc = yield Call(
                "find_one_and_update",
                (claim_filter(keys, names, worker_id, now), claim_pipeline(batch, worker_id, now)),
                options,
            )
        # the pipeline may have matched only to expire leases, adding no run of ours
        if doc is None or not _has_run(doc, run_id):
            return []
        doc["claim_run_id"] = run_id
        return [doc]
    # The common case first, in one lean stage; the full pipeline only for what it left.
    lean = yield Call(
        "update_many",
        (
            claim_lean_filter(keys, names, worker_id, now),
            claim_lean_pipeline(batch, worker_id, now),
        ),
    )
    modified = lean.modified_count
    if modified < len(keys):
        result = yield Call(
            "update_many",
            (claim_filter(keys, names, worker_id, now), claim_pipeline(batch, worker_id, now)),
        )
        modified += result.modified_count
    if modified == 0:
        return []
    claimed: list[Doc] = yield from read_claimed(keys, batch, fields)
    return claimed


def _has_run(doc: Doc, run_id: str) -> bool:
    return any(r.get("run_id") == run_id for r in doc.get("runs", ()))


def _run_filter(key: str, run_id: str) -> Doc:
    return {"_id": key, "runs": {"$elemMatch": {"run_id": run_id, "state": RUNNING}}}


def extend_lease(key: str, run_id: str, worker_id: str, now: dt.datetime) -> Op[Doc | None]:
    """Push the run's lease to ``now + worker_timeout_ms``. ``None`` means the run lost the
    task (taken over, released, cancelled, or this worker is no longer allowed): stop it."""
    filt = {
        **_run_filter(key, run_id),
        "status": {"$in": list(OPEN)},
        "$or": [{SPECIFIC: {"$size": 0}}, {SPECIFIC: worker_id}],
    }
    lease = {"lease_expires_at": {"$add": [now, "$options.worker_timeout_ms"]}}
    doc: Doc | None = yield Call(
        "find_one_and_update",
        (filt, [{"$set": {"runs": set_run_fields(run_id, lease)}}, *recompute_stages(now)]),
        {
            "return_document": ReturnDocument.AFTER,
            "projection": {"options": 1, "status": 1},
        },
    )
    return doc


@dataclass(frozen=True)
class Outcome:
    """How a run ended, for ``finish``/``finish_many``."""

    key: str
    run_id: str
    state: RunState
    result: Any = None
    error: str | None = None
    counts_as_failure: bool = True
    permanent: bool = False
    retry_delay_ms: int | None = None
    """Explicit delay before the task may be claimed again (FAIL); None: the task's backoff."""
    jitter: float = 1.0
    """Backoff multiplier drawn by the caller, e.g. uniform(0.8, 1.2)."""
    steps: tuple[Doc, ...] = ()
    """SUCCESS: next steps (``flows.outbox_entry``), written to the outbox with the success."""
    has_dependents: bool = False
    """Other tasks depend on this one: resolve them once the outcome is recorded."""


def _step_fields(outcome: Outcome) -> Doc:
    if not outcome.steps:
        return {}
    return {"outbox": list(outcome.steps), "children": [s["key"] for s in outcome.steps]}


def _backoff_expr(outcome: Outcome, now: dt.datetime) -> Any:
    if outcome.retry_delay_ms is not None:
        return now + dt.timedelta(milliseconds=outcome.retry_delay_ms)
    delay = {
        "$min": [
            "$options.max_retry_delay_ms",
            {
                "$multiply": [
                    "$options.retry_delay_ms",
                    {
                        "$pow": [
                            "$options.retry_backoff",
                            {"$max": [0, {"$subtract": ["$failures", 1]}]},
                        ]
                    },
                    outcome.jitter,
                ]
            },
        ]
    }
    return {"$add": [now, {"$toLong": {"$round": [delay, 0]}}]}


def finish_update(outcome: Outcome, now: dt.datetime) -> tuple[Doc, list[Doc]]:
    """Filter and pipeline that record ``outcome`` on its run, fenced by run id and RUNNING."""
    state = outcome.state
    run_fields: Doc = {"state": state.value, "finished_at": now}
    sets: Doc = {}
    if state is RunState.SUCCESS:
        run_fields["result"] = _lit(outcome.result)
        sets["successes"] = {"$add": ["$successes", 1]}
        sets["result"] = _lit(outcome.result)
        sets.update({k: _lit(v) for k, v in _step_fields(outcome).items()})
    elif state is RunState.FAIL:
        run_fields["error"] = _lit(outcome.error)
        sets["error"] = _lit(outcome.error)
        if outcome.counts_as_failure:
            sets["failures"] = {"$add": ["$failures", 1]}
        if outcome.permanent:
            sets["failed_permanently"] = True
    elif state is RunState.RELEASED:
        sets["available_at"] = now
    elif state is RunState.CANCELLED:
        run_fields["error"] = _lit(outcome.error)
    else:
        raise ValueError(f"a run cannot be finished as {state}")
    stages: list[Doc] = [{"$set": {"runs": set_run_fields(outcome.run_id, run_fields), **sets}}]
    if state is RunState.FAIL and not outcome.permanent:
        stages.append({"$set": {"available_at": _backoff_expr(outcome, now)}})
    return _run_filter(outcome.key, outcome.run_id), [*stages, *recompute_stages(now)]


def finish(outcome: Outcome, now: dt.datetime) -> Op[Doc | None]:
    """Record one run's outcome; ``None`` when the run no longer owns the task (fenced out)."""
    filt, pipeline = finish_update(outcome, now)
    doc: Doc | None = yield Call(
        "find_one_and_update", (filt, pipeline), {"return_document": ReturnDocument.AFTER}
    )
    return doc


def success_fast_update(outcome: Outcome, now: dt.datetime) -> tuple[Doc, Doc]:
    """The common case as a plain update: SUCCESS of a concurrency-1 task that is running.

    Its result is fully determined (succeeded, no next claim, nothing to fold), so it needs no
    pipeline; the filter keeps the same fence (run id + RUNNING) and adds the conditions that
    make the shortcut exact. A task it does not match gets the general pipeline instead."""
    filt = {
        **_run_filter(outcome.key, outcome.run_id),
        "status": TaskStatus.RUNNING.value,
        "options.concurrency": 1,
    }
    update = {
        "$set": {
            "runs.$.state": RunState.SUCCESS.value,
            "runs.$.finished_at": now,
            "runs.$.result": outcome.result,
            "result": outcome.result,
            "status": TaskStatus.SUCCEEDED.value,
            "next_claim_at": None,
            "finished_at": now,
            "updated_at": now,
            **_step_fields(outcome),
        },
        "$inc": {"successes": 1},
    }
    return filt, update


def outcome_requests(outcomes: Sequence[Outcome], now: dt.datetime) -> list[UpdateOne]:
    """One fenced update per outcome: the plain-update shortcut for SUCCESS, else the pipeline."""
    return [
        UpdateOne(*success_fast_update(o, now))
        if o.state is RunState.SUCCESS
        else UpdateOne(*finish_update(o, now))
        for o in outcomes
    ]


def _finish_unmatched(outcomes: Sequence[Outcome], now: dt.datetime) -> Op[int]:
    """After a bulk write that applied fewer updates than expected: SUCCESS outcomes whose run
    is still RUNNING were not matched by the shortcut (concurrency > 1, a cancelled task) and
    take the pipeline; the others were fenced out (their runs lost the task) and stay so."""
    success = {o.run_id: o for o in outcomes if o.state is RunState.SUCCESS}
    if not success:
        return 0
    open_runs = yield Call(
        "find",
        (
            {
                "_id": {"$in": [o.key for o in success.values()]},
                "runs": {"$elemMatch": {"run_id": {"$in": list(success)}, "state": RUNNING}},
            },
            {"runs.run_id": 1, "runs.state": 1},
        ),
    )
    pending = [
        success[r["run_id"]]
        for doc in open_runs
        for r in doc.get("runs", ())
        if r.get("state") == RUNNING and r.get("run_id") in success
    ]
    if not pending:
        return 0
    requests = [UpdateOne(*finish_update(o, now)) for o in pending]
    result = yield Call("bulk_write", (requests,), {"ordered": False})
    return int(result.modified_count)


def finish_many(outcomes: Sequence[Outcome], now: dt.datetime) -> Op[int]:
    """Record many outcomes in one unordered bulk write; returns how many were recorded."""
    if not outcomes:
        return 0
    result = yield Call("bulk_write", (outcome_requests(outcomes, now),), {"ordered": False})
    recorded = int(result.modified_count)
    if recorded != len(outcomes):
        recorded += yield from _finish_unmatched(outcomes, now)
    return recorded


def read_claimed(
    keys: Sequence[str], batch: str, fields: Mapping[str, int] | None = None
) -> Op[list[Doc]]:
    """The documents that batch ``batch`` claimed among ``keys``."""
    run_ids = [run_id_for(batch, k) for k in keys]
    projection = {**fields, "runs.run_id": 1} if fields is not None else None
    docs: list[Doc] = yield Call(
        "find", ({"_id": {"$in": list(keys)}, "runs.run_id": {"$in": run_ids}}, projection)
    )
    for doc in docs:
        doc["claim_run_id"] = run_id_for(batch, doc["_id"])
    return docs


def scan(
    names: Sequence[str],
    worker_id: str,
    limit: int,
    after: tuple[dt.datetime, str] | None = None,
) -> Op[list[Doc]]:
    """One page of open tasks for ``names`` that this worker may run, soonest claimable first;
    ``after`` is the (next_claim_at, key) of the previous page's last entry."""
    filt: Doc = {
        # Malformed documents are read too: the claim refuses them, and the worker then marks
        # them invalid (``quarantine``) instead of skipping them in silence.
        "name": {"$in": list(names)},
        "next_claim_at": {"$type": "date"},
        "$or": [
            {SPECIFIC: {"$size": 0}},
            {SPECIFIC: worker_id},
            {SPECIFIC: {"$not": {"$type": "array"}}},
        ],
    }
    if after is not None:
        at, key = after
        filt = {
            "$and": [
                filt,
                {
                    "$or": [
                        {"next_claim_at": {"$gt": at}},
                        {"next_claim_at": at, "_id": {"$gt": key}},
                    ]
                },
            ]
        }
    docs: list[Doc] = yield Call(
        "find",
        (filt, PLACEMENT_FIELDS),
        {"sort": [("next_claim_at", ASCENDING), ("_id", ASCENDING)], "limit": limit},
    )
    return docs
