"""Operations on tasks by anyone: publishing, reading, listing, cancel, retry, quarantine and the
worker's scan."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pymongo import ASCENDING, DESCENDING, ReturnDocument, UpdateOne
from pymongo.errors import BulkWriteError, DuplicateKeyError, OperationFailure

from mtask.driver import DUPLICATE_KEY, UNAUTHORIZED, Call, Doc, Op
from mtask.errors import InvalidTransition, TaskNotFound
from mtask.statemachine import (
    OPEN,
    RUNNING,
    recompute_stages,
)
from mtask.store import across
from mtask.store.complete import complete
from mtask.store.retention import resolve
from mtask.store.schema import (
    GROUP_LOCK,
    PLACEMENT_FIELDS,
    SPECIFIC,
    WELL_FORMED,
    invalid_reason_expr,
    keys_in,
    literal,
    marked_invalid,
    new_document,
    well_formed_expr,
)
from mtask.vocabulary import OnConflict, TaskStatus

if TYPE_CHECKING:
    from mtask.models import NewTask

# ---------------------------------------------------------------------------------------------
# Publishing
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Published:
    created: bool
    updated: bool
    document: Doc


def publish(
    task: NewTask,
    now: dt.datetime,
    on_conflict: OnConflict = "ignore",
    trace: dict[str, str] | None = None,
    retention: Mapping[str, Doc] | None = None,
    upsert: bool = False,
) -> Op[Published]:
    """Insert the task if its key is new (``insert_if_absent``); otherwise apply
    ``on_conflict``: ``ignore`` leaves it, ``update_params`` replaces params and options of a
    task that is not running, ``reset`` makes a finished task new again. Unset retention
    options are resolved first (``retention.resolve``). ``trace`` is the publisher's W3C trace
    context (``mtask.tracing.publish_span``), stored as ``trace``. ``retention``: the
    retention defaults, if the caller has them (``retention.DefaultsCache``). ``upsert``: for
    a caller's session (``insert_if_absent``)."""
    task = (yield from resolve([task], retention))[0]
    doc = new_document(task, now)
    if trace:
        doc["trace"] = trace
    before = yield from insert_if_absent(doc, upsert)
    if before is None:
        return Published(created=True, updated=False, document=doc)
    if on_conflict == "ignore":
        return Published(created=False, updated=False, document=before)
    if on_conflict == "update_params":
        filt: Doc = {"_id": task.key, "status": {"$ne": TaskStatus.RUNNING.value}}
        sets: Doc = {"params": literal(task.params), "options": literal(task.options.to_document())}
        if task.options.run_at is not None:
            sets["available_at"] = task.options.run_at
        # a task moved to another group leaves its old group's lock (a sequence's: a retried
        # holder keeps it), so that group's next task may go and the unique group_lock index
        # never refuses the move; a task that stays in its group keeps its lock
        stays = {"$eq": ["$options.group", task.options.group]}
        moved = {
            "$set": {
                GROUP_LOCK: {"$cond": [stays, f"${GROUP_LOCK}", "$$REMOVE"]},
                # a task moved to another group leaves its supersede rule (the unique
                # index would refuse the move while that group has its own open holder)
                "supersede": {"$cond": [stays, "$supersede", "$$REMOVE"]},
            }
        }
        pipeline = [moved, {"$set": sets}, *recompute_stages(now)]
    else:  # reset
        filt = {
            "_id": task.key,
            "status": {"$in": [s.value for s in TaskStatus if s.finished]},
            "runs": {"$not": {"$elemMatch": {"state": RUNNING, "lease_expires_at": {"$gt": now}}}},
        }
        # the output's numbering goes on (as across retries): the old runs' entries keep
        # their ``seq`` until retention removes them with the task, and the new run's first
        # line must not take one of them (a missing ``output_seq`` stays missing)
        kept = {"_id": "$_id", "created_at": "$created_at", "output_seq": "$output_seq"}
        fresh = {k: v for k, v in doc.items() if k not in kept}
        pipeline = [{"$replaceWith": {"$mergeObjects": [kept, literal(fresh)]}}]
    after = yield Call(
        "find_one_and_update",
        (filt, pipeline),
        {"return_document": ReturnDocument.AFTER},
    )
    if after is None:
        current = yield Call("find_one", ({"_id": task.key},))
        return Published(created=False, updated=False, document=current or before)
    return Published(created=False, updated=True, document=after)


def insert_if_absent(doc: Doc, upsert: bool = False) -> Op[Doc | None]:
    """Insert ``doc`` unless a document has its ``_id``; returns that document (None: inserted).

    A new key costs one ``insert``, which mongod applies more cheaply than an upsert that
    returns the document before it. A key that exists costs the refused insert and then that
    upsert, which reads the document on the primary (or inserts ``doc``, if it was removed in
    between). ``upsert``: the upsert alone, for a caller's session — in a transaction a refused
    insert would abort the caller's transaction, an upsert does not.

    A publisher whose role may not update (``mtask.security.roles``: ``update`` on the tasks would
    let it change any task) has that upsert refused; it reads the document instead, and inserts
    again if it was removed in between."""
    if not upsert:
        try:
            yield Call("insert_one", (doc,))
            return None
        except DuplicateKeyError:  # the key exists, or another publish inserted it first
            pass
    fields = {k: v for k, v in doc.items() if k != "_id"}
    call = Call(
        "find_one_and_update",
        ({"_id": doc["_id"]}, {"$setOnInsert": fields}),
        {"upsert": True, "return_document": ReturnDocument.BEFORE},
    )
    try:
        try:
            found: Doc | None = yield call
        except DuplicateKeyError:  # two upserts raced on a new key; the other one inserted
            found = yield call
    except OperationFailure as exc:
        if exc.code != UNAUTHORIZED or upsert:
            raise
        return (yield from _read_or_insert(doc))
    return found


def _read_or_insert(doc: Doc) -> Op[Doc | None]:
    """The document with ``doc``'s key, read; inserted if none is there (None)."""
    while True:
        found: Doc | None = yield Call("find_one", ({"_id": doc["_id"]},))
        if found is not None:
            return found
        try:
            yield Call("insert_one", (doc,))
            return None
        except DuplicateKeyError:
            continue


def publish_many(
    tasks: Sequence[NewTask],
    now: dt.datetime,
    batch_size: int = 1000,
    created_by_name: dict[str, int] | None = None,
    trace: dict[str, str] | None = None,
    retention: Mapping[str, Doc] | None = None,
) -> Op[int]:
    """Insert-if-absent many tasks with unordered bulk upserts; returns how many were created
    (and counts them per name into ``created_by_name``, if given)."""
    created = 0
    tasks = yield from resolve(tasks, retention)
    # a task that others of this batch depend on is born knowing it (so that the worker that
    # records its outcome resolves them, even if it claims it before anyone marks it)
    awaited = {d for task in tasks for d in task.depends_on}
    # every request is made before the first write: what fails, fails with nothing written
    # (a validated task is always encodable: models.NewTask)
    requests, docs = [], []
    for index, task in enumerate(tasks):
        doc = new_document(task, now, index)
        del doc["_id"]
        if trace:
            doc["trace"] = trace
        if task.key in awaited:
            doc["has_dependents"] = True
        requests.append(UpdateOne({"_id": task.key}, {"$setOnInsert": doc}, upsert=True))
        docs.append({"_id": task.key, **doc})
    for start in range(0, len(requests), batch_size):
        batch = requests[start : start + batch_size]
        try:
            result = yield Call("bulk_write", (batch,), {"ordered": False})
        except OperationFailure as exc:
            if exc.code != UNAUTHORIZED:
                raise
            result = yield from _insert_new(docs[start : start + batch_size])
        created += result.upserted_count
        if created_by_name is not None:
            for index in result.upserted_ids:
                name = tasks[start + index].name
                created_by_name[name] = created_by_name.get(name, 0) + 1
    return created


@dataclass(frozen=True)
class _Inserted:
    """What ``_insert_new`` did, as a bulk write's result says it."""

    upserted_ids: list[int]

    @property
    def upserted_count(self) -> int:
        return len(self.upserted_ids)


def _insert_new(docs: Sequence[Doc]) -> Op[_Inserted]:
    """A batch inserted instead of upserted, those whose key exists left alone: for a
    publisher whose role may not update (``insert_if_absent``). Returns the indexes of those
    inserted."""
    try:
        yield Call("insert_many", (docs,), {"ordered": False})
    except BulkWriteError as exc:
        errors = exc.details.get("writeErrors", [])
        if any(e.get("code") != DUPLICATE_KEY for e in errors):
            raise
        refused = {e["index"] for e in errors}
        return _Inserted([i for i in range(len(docs)) if i not in refused])
    return _Inserted(list(range(len(docs))))


# ---------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------


def get(key: str) -> Op[Doc | None]:
    doc: Doc | None = yield Call("find_one", ({"_id": key},))
    return doc


def missing_keys(keys: Sequence[str]) -> Op[list[str]]:
    """The ``keys`` no task has, in their order (a dependency never published, or purged)."""
    if not keys:
        return []
    found: list[Doc] = yield Call("find", ({"_id": {"$in": list(keys)}}, {"_id": 1}))
    have = {d["_id"] for d in found}
    return [k for k in dict.fromkeys(keys) if k not in have]


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
            {**PLACEMENT_FIELDS, "well_formed": well_formed_expr()},
        ),
    )
    return docs


def quarantine(keys: Sequence[Any], now: dt.datetime, reason: str | None = None) -> Op[int]:
    """Settle documents among ``keys`` that no claim can ever match: complete a publisher's
    status-less document (``store.complete``), and mark an open (or unknown-status) one that
    is malformed ``invalid``, with the reason, taking it out of the claim index. Matches only
    documents that are still so, so a fixed one is left alone. With ``reason`` (a claim failed
    on the document itself), the open documents among ``keys`` whatever they hold. Returns how
    many were marked invalid."""
    keys = list(keys)
    completed_invalid = 0
    if reason is None:
        _, completed_invalid = yield from complete(keys)
    # has a status (else complete handles it) that is not a finished one, compared as a
    # value ($expr): an array status holding "succeeded" is not finished
    settled: list[Doc] = [
        {"$not": [{"$in": [{"$type": "$status"}, ["missing", "null"]]}]},
        {"$not": [{"$in": ["$status", FINISHED]}]},
    ]
    if reason is None:
        settled.append({"$not": [well_formed_expr()]})
    filt: Doc = {**keys_in(keys), "$expr": {"$and": settled}}
    result = yield Call(
        "update_many",
        (
            filt,
            [marked_invalid(invalid_reason_expr() if reason is None else literal(reason), now)],
        ),
    )
    count: int = result.modified_count
    return count + completed_invalid


FINISHED = [s.value for s in TaskStatus if s.finished]


LIST_ORDERS = ("newest", "next_claim_at")


def list_query(
    name: str | None,
    status: str | None,
    order: str = "newest",
    group: str | None = None,
) -> tuple[Doc, list[tuple[str, int]]]:
    """A list's filter and order (a status without a name is read name by name:
    ``across_names``)."""
    filt: Doc = {}
    if name is not None:
        filt["name"] = name
    if group is not None:
        filt["options.group"] = {"$eq": group, "$type": "string"}
    if status is not None:
        filt["status"] = status
    if order == "next_claim_at":
        filt["next_claim_at"] = {"$type": "date"}
        return filt, [("next_claim_at", ASCENDING), ("_id", ASCENDING)]
    return filt, [("created_at", DESCENDING), ("_id", DESCENDING)]


def across_names(name: str | None, status: Any) -> bool:
    """Whether a query by ``status`` is read name by name (``store.across``): it has no
    name."""
    return name is None and status is not None


def list_tasks(
    name: str | None = None,
    status: str | None = None,
    limit: int = 100,
    after: str | None = None,
    order: str = "newest",
    group: str | None = None,
) -> Op[list[Doc]]:
    """A page of tasks, newest first (or soonest claimable first); ``after`` is the last key of
    the previous page."""
    filt, sort = list_query(name, status, order, group)
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
    return (yield from across.find_page(filt, sort, limit, across_names(name, status)))


# ---------------------------------------------------------------------------------------------
# Operator actions
# ---------------------------------------------------------------------------------------------


def _problem() -> Doc:
    """What makes a document malformed (``invalid_reason_expr``), or null."""
    return {"$cond": [well_formed_expr(), None, invalid_reason_expr()]}


def _require(key: str, doc: Doc | None, action: str, allowed: Iterable[str]) -> Op[Doc]:
    """``doc``, the task ``action`` changed; else why it changed nothing: no such task, a
    status ``action`` does not apply to, or a malformed document (``InvalidTransition``)."""
    if doc is not None:
        return doc
    current = yield Call("find_one", ({"_id": key}, {"status": 1, "problem": _problem()}))
    if current is None:
        raise TaskNotFound(key)
    if current.get("status") in allowed and current.get("problem") is not None:
        raise InvalidTransition(f"cannot {action} task {key!r}: {current['problem']}")
    raise InvalidTransition(
        f"cannot {action} task {key!r}: it is {current.get('status')}; "
        f"{action} applies to {' or '.join(allowed)} tasks"
    )


CANCEL_CHILDREN = "cancel_children_at"
"""On a task cancelled while a run of it ran and it had spawned children: when that run's
lease ends (it is not pinged any more). That run may still publish children until it stops;
the flow sweep cancels the children of such a task once the time has passed, then removes the
field (``store.children.sweep_cancelled``): children published by a run that died between its
publish and its look at its parent (``store.children.publish``) are cancelled too."""


def cancel_pipeline(now: dt.datetime) -> list[Doc]:
    """The update that cancels an open task (its filter: ``OPEN`` and ``WELL_FORMED``)."""
    running = {"$filter": {"input": "$runs", "as": "r", "cond": {"$eq": ["$$r.state", RUNNING]}}}
    until = {"$max": {"$map": {"input": running, "as": "r", "in": "$$r.lease_expires_at"}}}
    spawning = {
        "$and": [
            {"$eq": [{"$type": "$spawned"}, "object"]},
            {"$eq": [{"$type": until}, "date"]},
        ]
    }
    mark = {"$cond": [spawning, until, {"$ifNull": [f"${CANCEL_CHILDREN}", "$$REMOVE"]}]}
    return [
        {"$set": {"status": TaskStatus.CANCELLED.value, CANCEL_CHILDREN: mark}},
        *recompute_stages(now),
    ]


def cancel(key: str, now: dt.datetime) -> Op[Doc]:
    """pending or running -> cancelled at once. A running handler is stopped by its worker at
    the next ping (the ping matches only open tasks), and its run is then marked CANCELLED."""
    doc = yield Call(
        "find_one_and_update",
        (
            # well formed: the server refuses the recompute over a document without its fields
            {"_id": key, "status": {"$in": list(OPEN)}, **WELL_FORMED},
            cancel_pipeline(now),
        ),
        {"return_document": ReturnDocument.AFTER},
    )
    result: Doc = yield from _require(key, doc, "cancel", OPEN)
    return result


RETRIABLE = (TaskStatus.FAILED.value, TaskStatus.CANCELLED.value)


def retry_filter(key: str, now: dt.datetime) -> Doc:
    """Which task a retry may reopen: failed or cancelled, well formed, and no run of it
    RUNNING with a live lease (a cancelled run's handler may still be stopping)."""
    return {
        "_id": key,
        "status": {"$in": list(RETRIABLE)},
        **WELL_FORMED,  # the server refuses the recompute over a document without its fields
        "runs": {
            "$type": "array",
            "$not": {"$elemMatch": {"state": RUNNING, "lease_expires_at": {"$gt": now}}},
        },
    }


def retry(key: str, now: dt.datetime) -> Op[Doc]:
    """failed or cancelled -> pending, with a fresh retry budget. Refused while a cancelled
    run's handler may still be stopping (a RUNNING run with a live lease)."""
    doc = yield Call(
        "find_one_and_update",
        (retry_filter(key, now), [*RESPAWN, *retry_pipeline(now)]),
        {"return_document": ReturnDocument.AFTER},
    )
    if doc is None:
        yield from _not_retried(key)
    result: Doc = yield from _require(key, doc, "retry", RETRIABLE)
    return result


_LAST: Doc = {"$arrayElemAt": [{"$cond": [{"$isArray": "$steps"}, "$steps", []]}, -1]}
_AGAIN: Doc = {
    "$let": {
        "vars": {"last": _LAST},
        "in": {
            "$and": [
                {"$eq": ["$$last.kind", "children"]},
                {"$ne": ["$$last.state", "done"]},
            ]
        },
    }
}
RESPAWN: list[Doc] = [
    {
        "$set": {
            "steps": {
                "$cond": [
                    _AGAIN,
                    {"$filter": {"input": "$steps", "cond": {"$ne": ["$$this", _LAST]}}},
                    "$steps",
                ]
            },
            "waiting": {"$cond": [_AGAIN, "$$REMOVE", "$waiting"]},
        }
    }
]
"""A retry's first stage: a journal that ends in a spawn whose children failed (or were
cancelled while it waited) loses that step, so that the next run spawns its children again
(``mtask.steps.children``: a new generation of them), as a retry calls a failed step again. A
spawn whose ``ChildFailed`` the handler caught and went on is not the last step: it replays."""


def _not_retried(key: str) -> Op[None]:
    """Why a retry matched nothing, when it is a run still stopping."""
    current = yield Call("find_one", ({"_id": key}, {"status": 1, "problem": _problem()}))
    if current is not None and current.get("status") in RETRIABLE and not current.get("problem"):
        raise InvalidTransition(
            f"cannot retry task {key!r} yet: a cancelled run is still stopping; "
            "try again after its lease ends"
        )


def retry_pipeline(now: dt.datetime) -> list[Doc]:
    """The update that reopens a failed or cancelled task with a fresh retry budget."""
    return [
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
        # a sequence's task reopened takes its group's lock anew; a superseded task reopened
        # runs outside the supersede rule (its group may have a newer open holder)
        {"$unset": [GROUP_LOCK, "supersede"]},
        *recompute_stages(now),
    ]


def scan(
    names: Sequence[str],
    worker_id: str | Sequence[str],
    limit: int,
    after: tuple[dt.datetime, str] | None = None,
    *,
    start: tuple[dt.datetime, str] | None = None,
    batch_size: int = 0,
) -> Op[list[Doc]]:
    """One page of open tasks for ``names`` that this worker (or one of these workers: a
    host's relay scans for all of them) may run, soonest claimable first; ``after`` is the
    (next_claim_at, key) of the previous page's last entry, ``start`` that of the page's first
    (a top-up reading on from the first task a full queue left out). ``batch_size``: how many
    documents each reply carries (0: the server's choice), so a long page is decoded a batch
    at a time, the event loop running between."""
    filt: Doc = {
        # Malformed documents are read too: the claim refuses them, and the worker then marks
        # them invalid (``quarantine``) instead of skipping them in silence.
        "name": {"$in": list(names)},
        "next_claim_at": {"$type": "date"},
        # A key of another type is the sweep's (``stranded_quick``): it is never queued, and
        # paging by (next_claim_at, _id) compares within one BSON type only.
        "_id": {"$type": "string"},
        "$or": [
            {SPECIFIC: {"$size": 0}},
            {SPECIFIC: worker_id if isinstance(worker_id, str) else {"$in": list(worker_id)}},
            {SPECIFIC: {"$not": {"$type": "array"}}},
        ],
    }
    bound, tie = (after, "$gt") if after is not None else (start, "$gte")
    if bound is not None:
        # The bound for each name on its own: the index (name, next_claim_at, _id) then bounds
        # each name's scan. Across an `$in` of names, the planner merges each name's whole
        # range and filters after the fetch, reading every earlier task again (explained:
        # 15,001 documents read for a page of 5,001 with two names, against 5,001).
        at, key = bound
        del filt["name"]
        filt = {
            "$and": [
                filt,
                {
                    "$or": [
                        branch
                        for name in names
                        for branch in (
                            {"name": name, "next_claim_at": {"$gt": at}},
                            {"name": name, "next_claim_at": at, "_id": {tie: key}},
                        )
                    ]
                },
            ]
        }
    options: Doc = {"sort": [("next_claim_at", ASCENDING), ("_id", ASCENDING)], "limit": limit}
    if bound is not None:
        # In a drain's mix of open and running tasks, the planner chose the `_id` index for the
        # `_id` bound of one branch: 20,000 documents read for a reply of 1,000 (the profiler).
        options["hint"] = "claim"
    if batch_size:
        options["batch_size"] = batch_size
    docs: list[Doc] = yield Call("find", (filt, PLACEMENT_FIELDS), options)
    return docs


def keep_trace(key: str, run_id: str, trace: Mapping[str, str]) -> Op[bool]:
    """Store ``trace`` as the task's trace context (``mtask.tracing.run_span``: its first
    run's, when its publisher stored none), fenced by the run (its task running, the run
    RUNNING) and only where none is stored: every later run of the task joins that trace.
    Whether it was stored."""
    filt: Doc = {
        "_id": key,
        "status": TaskStatus.RUNNING.value,
        "runs": {"$elemMatch": {"run_id": run_id, "state": RUNNING}},
        "trace": {"$exists": False},
    }
    result = yield Call("update_one", (filt, {"$set": {"trace": dict(trace)}}))
    return bool(result.modified_count)
