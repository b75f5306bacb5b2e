"""The worker's claim (one key, or a batch: the lean stage, then the full pipeline), reading
what a batch claimed, and extending a lease."""

from __future__ import annotations

import datetime as dt
import re
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from pymongo import UpdateOne
from pymongo.errors import BulkWriteError, WriteError

from mtask.driver import DUPLICATE_KEY, MODIFY_ONCE, Call, Doc, Op
from mtask.security.encryption import MARK, UNOPENED
from mtask.statemachine import (
    OPEN,
    RUNNING,
    count_expired_expr,
    expire_leases_expr,
    live_runs_expr,
    recompute_stages,
    set_run_fields,
)
from mtask.store.schema import (
    GROUP_LOCK,
    LAST_WRITE,
    SPECIFIC,
    WELL_FORMED,
    claim_tag,
    literal,
)
from mtask.vocabulary import RunState, TaskStatus

CLAIM_TIMEOUT_S = 5.0
"""The most a claim call may take (``Call.timeout``). A claim that would take over a task
whose document an open transaction has written (a transactional run frozen or killed between
its fenced SUCCESS and its commit) waits for that transaction, which the server keeps until
``transactionLifetimeLimitSeconds``; this bounds the wait, and the claimer then kills that
transaction (``ClaimCalls.kill_stale_transactions``)."""


def unopened_by(worker_id: str) -> Doc:
    """What the claims of a worker that cannot decrypt every encrypted task add to their filter
    (``skip_unopened``): not an encrypted task this worker gave back undecrypted (a run of its
    own RELEASED saying so, ``mtask.worker.running.sealing``). Claims are by key, so this is
    read of the one document the ``_id`` index found; a worker that never met such a task does
    not add it."""
    said = f"^{re.escape(f'{UNOPENED} `{worker_id}`')}"
    mine = {"worker_id": worker_id, "state": RunState.RELEASED.value, "error": {"$regex": said}}
    return {"$nor": [{f"params.{MARK}": {"$exists": True}, "runs": {"$elemMatch": mine}}]}


def _skipping(worker_id: str, skip_unopened: bool) -> Doc:
    return unopened_by(worker_id) if skip_unopened else {}


def claim_filter(
    keys: Sequence[str],
    names: Sequence[str],
    worker_id: str,
    now: dt.datetime,
    skip_unopened: bool = False,
) -> Doc:
    """The claim filter, all of it decided on the server in one atomic update (``skip_unopened``:
    ``unopened_by`` too)."""
    mine = {
        "$map": {
            "input": "$runs",
            "as": "r",
            "in": {
                "$and": [
                    {"$eq": ["$$r.worker_id", literal(worker_id)]},
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
        "_id": _keys_filter(keys),
        "name": {"$in": list(names)},
        "status": {"$in": list(OPEN)},
        "next_claim_at": {"$type": "date", "$lte": now},
        "$or": [{SPECIFIC: {"$size": 0}}, {SPECIFIC: worker_id}],
        **WELL_FORMED,
        **_skipping(worker_id, skip_unopened),
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


def _keys_filter(keys: Sequence[str]) -> Any:
    """String keys among ``keys``: one key by equality (a single-document write on a sharded
    collection names its shard key exactly; scale.md, "Sharding"), more by ``$in``."""
    if len(keys) == 1 and isinstance(keys[0], str):
        return keys[0]
    return {"$in": list(keys), "$type": "string"}


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
        {"$concat": [literal(f"{batch}-"), "$_id"]},
        literal(worker_id),
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
                # only when a run was added (a match that merely expired leases is not ours)
                LAST_WRITE: {"$cond": ["$_claim", literal(claim_tag(worker_id)), f"${LAST_WRITE}"]},
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
    key: str,
    names: Sequence[str],
    worker_id: str,
    now: dt.datetime,
    run_id: str,
    timeout_ms: int,
    skip_unopened: bool = False,
) -> tuple[Doc, Doc]:
    """The common claim as a plain update: a pending, concurrency-1 task whose lease length
    is ``timeout_ms``. Pending means no RUNNING run (so no lease to expire and the slot is
    free) and retries left; fewer than 20 runs means nothing to fold. So the pipeline's result
    is known in advance; the filter makes sure each of these holds."""
    lease = now + dt.timedelta(milliseconds=timeout_ms)
    filt = {
        **claim_lean_filter([key], names, worker_id, now, skip_unopened),
        "options.worker_timeout_ms": timeout_ms,
    }
    update = {
        "$push": {"runs": _new_run(run_id, worker_id, now, lease)},
        "$inc": {"attempts": 1},
        "$set": {
            "status": TaskStatus.RUNNING.value,
            "next_claim_at": lease,
            "updated_at": now,
            LAST_WRITE: claim_tag(worker_id),
        },
    }
    return filt, update


def claim_lean_filter(
    keys: Sequence[str],
    names: Sequence[str],
    worker_id: str,
    now: dt.datetime,
    skip_unopened: bool = False,
) -> Doc:
    """The batch form of ``claim_fast_update``'s filter: pending concurrency-1 tasks with
    fewer than 20 runs, for which the claim pipeline's result is known in advance."""
    return {
        "_id": _keys_filter(keys),  # run ids are built from keys
        "name": {"$in": list(names)},
        "status": TaskStatus.PENDING.value,
        "next_claim_at": {"$type": "date", "$lte": now},
        "$or": [{SPECIFIC: {"$size": 0}}, {SPECIFIC: worker_id}],
        **WELL_FORMED,
        **_skipping(worker_id, skip_unopened),
        "options.concurrency": 1,
        "runs.19": {"$exists": False},
    }


def claim_lean_pipeline(batch: str, worker_id: str, now: dt.datetime) -> list[Doc]:
    """What ``claim_pipeline`` does to a document ``claim_lean_filter`` matches, in one stage:
    no lease to expire, a free slot, retries left, nothing to fold."""
    lease = {"$add": [now, "$options.worker_timeout_ms"]}
    new_run = _new_run({"$concat": [literal(f"{batch}-"), "$_id"]}, literal(worker_id), now, lease)
    return [
        {
            "$set": {
                "runs": {"$concatArrays": ["$runs", [new_run]]},
                "attempts": {"$add": ["$attempts", 1]},
                "status": TaskStatus.RUNNING.value,
                "next_claim_at": lease,
                "updated_at": now,
                LAST_WRITE: literal(claim_tag(worker_id)),
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
    skip_unopened: bool = False,
) -> Op[list[Doc]]:
    """Claim as many of ``keys`` as the server allows. Returns the claimed documents (only
    ``fields`` of them, if given); this worker's run is the one whose ``run_id`` is the
    ``claim_run_id`` added to each.

    One key: one ``findAndModify``, not a retryable write (``MODIFY_ONCE``: the claimer adopts
    what a failed claim took); if ``timeouts`` gives its ``worker_timeout_ms`` as this worker
    last saw it, the plain-update shortcut (``claim_fast_update``) is tried first.
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
        # not a retryable write (MODIFY_ONCE): a claim's caller adopts what a failed call took
        options: dict[str, Any] = {"new": True}
        if fields is not None:
            options["fields"] = {**fields, "runs.run_id": 1}
        doc = None
        if key in timeouts:
            doc = yield Call(
                MODIFY_ONCE,
                claim_fast_update(key, names, worker_id, now, run_id, timeouts[key], skip_unopened),
                options,
                timeout=CLAIM_TIMEOUT_S,
            )
        if doc is None:
            doc = yield Call(
                MODIFY_ONCE,
                (
                    claim_filter(keys, names, worker_id, now, skip_unopened),
                    claim_pipeline(batch, worker_id, now),
                ),
                options,
                timeout=CLAIM_TIMEOUT_S,
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
            claim_lean_filter(keys, names, worker_id, now, skip_unopened),
            claim_lean_pipeline(batch, worker_id, now),
        ),
        timeout=CLAIM_TIMEOUT_S,
    )
    modified = lean.modified_count
    if modified < len(keys):
        result = yield Call(
            "update_many",
            (
                claim_filter(keys, names, worker_id, now, skip_unopened),
                claim_pipeline(batch, worker_id, now),
            ),
            timeout=CLAIM_TIMEOUT_S,
        )
        modified += result.modified_count
    if modified == 0:
        return []
    claimed: list[Doc] = yield from read_claimed(keys, batch, fields)
    return claimed


def lock_stage(batch: str) -> Doc:
    """The stage a sequence's claim ends with: the task holds its group's lock if this batch's
    run was added (a match that merely expired leases takes no lock)."""
    ours = {"$in": [{"$concat": [literal(f"{batch}-"), "$_id"]}, "$runs.run_id"]}
    return {"$set": {GROUP_LOCK: {"$cond": [ours, True, f"${GROUP_LOCK}"]}}}


LOCKED_TRIES = 4
"""Batch claims of sequences' heads that busy groups may cost before what is left is claimed
one update each."""


def claim_locked(
    groups: Mapping[str, tuple[str, str]],
    names: Sequence[str],
    worker_id: str,
    now: dt.datetime,
    fields: Mapping[str, int] | None = None,
    batch: str | None = None,
    skip_unopened: bool = False,
) -> Op[tuple[list[Doc], set[str], dict[str, str]]]:
    """Claim the keys of ``groups``, each the next task of the sequence ``(name, group)``, each
    taking its group's lock in the same update (``group_lock``, docs/flow-control.md).

    The ``group_lock`` index lets one open task of a group hold the lock: the update of a key
    whose group another open task holds fails on it (a duplicate key, naming the group), and
    that key is **busy**. One ``update_many`` of the lean stage claims the batch; as a
    multi-document update stops at its first error, it is sent again without a busy key (at
    most ``LOCKED_TRIES`` times in all: ``_claim_locked_lean``). One read of what was claimed;
    what is left (a takeover, more busy groups, a document the lean stage does not fit) gets
    one update per key of the full pipeline in one unordered bulk, and a read
    (``_claim_locked_full``). Returns the claimed documents, the busy keys, and the keys the
    server could not update with why."""
    keys = list(groups)
    if not keys:
        return [], set(), {}
    batch = batch or uuid.uuid4().hex
    busy: set[str] = yield from _claim_locked_lean(
        groups, names, worker_id, now, batch, skip_unopened
    )
    claimed: list[Doc] = yield from read_claimed(keys, batch, fields)
    got = {d["_id"] for d in claimed}
    rest = [k for k in keys if k not in got and k not in busy]
    broken: dict[str, str] = {}
    if rest:
        claimed += yield from _claim_locked_full(
            rest, names, worker_id, now, batch, fields, busy, broken, skip_unopened
        )
    return claimed, busy, broken


GROUPED = {"options.group": {"$type": "string"}}
"""What a sequence's claim adds to its filter: the task has a group."""


def _claim_locked_lean(
    groups: Mapping[str, tuple[str, str]],
    names: Sequence[str],
    worker_id: str,
    now: dt.datetime,
    batch: str,
    skip_unopened: bool = False,
) -> Op[set[str]]:
    """The lean stage with the lock, sent again without the keys of each busy group its
    duplicate key names (``LOCKED_TRIES`` sends at most); returns the busy keys."""
    (stage,) = claim_lean_pipeline(batch, worker_id, now)  # one stage, the lock in it
    lean = [{"$set": {**stage["$set"], GROUP_LOCK: True}}]
    busy: set[str] = set()
    left = list(groups)
    for _ in range(LOCKED_TRIES):
        try:
            yield Call(
                "update_many",
                (
                    {**claim_lean_filter(left, names, worker_id, now, skip_unopened), **GROUPED},
                    lean,
                ),
                timeout=CLAIM_TIMEOUT_S,
            )
            break
        except WriteError as exc:
            culprits = _busy_keys(exc, groups, left)
            busy |= culprits
            left = [k for k in left if k not in culprits]
            if not culprits or not left:
                break
    return busy


def _busy_keys(
    exc: WriteError, groups: Mapping[str, tuple[str, str]], left: Sequence[str]
) -> set[str]:
    """The keys of ``left`` in the group a duplicate key on ``group_lock`` names (none for
    another error: the full pipeline's bulk names the document)."""
    if exc.code != DUPLICATE_KEY:
        return set()
    value = (exc.details or {}).get("keyValue") or {}
    pair = (value.get("name"), value.get("options.group"))
    return {k for k in left if tuple(groups[k]) == pair}


def _claim_locked_full(
    keys: list[str],
    names: Sequence[str],
    worker_id: str,
    now: dt.datetime,
    batch: str,
    fields: Mapping[str, int] | None,
    busy: set[str],
    broken: dict[str, str],
    skip_unopened: bool = False,
) -> Op[list[Doc]]:
    """The full pipeline with the lock, one update per key in one unordered bulk; returns what
    it claimed (read back), noting the busy and broken keys."""
    full = [
        UpdateOne(
            {**claim_filter([k], names, worker_id, now, skip_unopened), **GROUPED},
            [*claim_pipeline(batch, worker_id, now), lock_stage(batch)],
        )
        for k in keys
    ]
    if not (yield from _bulk(keys, full, busy, broken)):
        return []
    claimed: list[Doc] = yield from read_claimed(keys, batch, fields)
    return claimed


def _bulk(
    keys: Sequence[str], requests: list[UpdateOne], busy: set[str], broken: dict[str, str]
) -> Op[int]:
    """One unordered bulk write of one request per key; returns how many it modified, noting
    the keys refused by a held group lock (``busy``) or another write error (``broken``)."""
    try:
        result = yield Call("bulk_write", (requests,), {"ordered": False}, timeout=CLAIM_TIMEOUT_S)
    except BulkWriteError as exc:
        details = exc.details or {}
        if details.get("writeConcernErrors"):
            raise
        for error in details.get("writeErrors", ()):
            key = keys[int(error["index"])]
            if error.get("code") == DUPLICATE_KEY:
                busy.add(key)
            else:
                broken[key] = str(error.get("errmsg", error.get("code")))
        return int(details.get("nModified", 0))
    return int(result.modified_count)


def _has_run(doc: Doc, run_id: str) -> bool:
    return any(r.get("run_id") == run_id for r in doc.get("runs", ()))


def run_filter(key: str, run_id: str) -> Doc:
    return {"_id": key, "runs": {"$elemMatch": {"run_id": run_id, "state": RUNNING}}}


LEASE_FIELDS = {"options": 1, "status": 1}
STOPPABLE = TaskStatus.CANCELLED.value
"""A cancelled task's run still stopping keeps its lease (``lease_update``'s ``stopping``)."""
"""What a lease's extension returns of the task document."""


def lease_update(
    key: str,
    run_id: str,
    worker_id: str,
    now: dt.datetime,
    run_fields: Mapping[str, Any] | None = None,
    stopping: bool = False,
) -> tuple[Doc, list[Doc]]:
    """The fenced update that pushes the run's lease to ``now + worker_timeout_ms``, while the
    run is RUNNING and this worker is still allowed; ``run_fields``: more fields of the run
    entry to set in the same update. ``stopping``: the lease of a run being stopped whose
    handler has not stopped yet (its task cancelled, or this worker no longer allowed), kept
    while the run is RUNNING so that its sequence's lock and its limit slots stay held until
    it has really stopped (docs/flow-control.md); its outcome ends it."""
    filt: Doc = {**run_filter(key, run_id), "status": {"$in": [*OPEN, STOPPABLE]}}
    if not stopping:
        filt["status"] = {"$in": list(OPEN)}
        filt["$or"] = [{SPECIFIC: {"$size": 0}}, {SPECIFIC: worker_id}]
    lease = {
        "lease_expires_at": {"$add": [now, "$options.worker_timeout_ms"]},
        **(run_fields or {}),
    }
    return filt, [{"$set": {"runs": set_run_fields(run_id, lease)}}, *recompute_stages(now)]


def extend_lease(
    key: str,
    run_id: str,
    worker_id: str,
    now: dt.datetime,
    max_time_ms: int | None = None,
    stopping: bool = False,
) -> Op[Doc | None]:
    """A ping: push the run's lease to ``now + worker_timeout_ms``. ``None`` means the run lost
    the task (taken over, released, cancelled, or this worker is no longer allowed): stop it.

    Not a retryable write (``MODIFY_ONCE``): a ping that failed is sent again within half a
    second, and pushing a lease twice is pushing it once. ``max_time_ms`` bounds the update on
    the server: a write outside a transaction waits for an open transaction that wrote the
    same document (a transactional run between its fenced SUCCESS and its commit), and the
    pinger, one thread for all runs, must not wait with it."""
    limit = {} if max_time_ms is None else {"maxTimeMS": max_time_ms}
    doc: Doc | None = yield Call(
        MODIFY_ONCE,
        lease_update(key, run_id, worker_id, now, stopping=stopping),
        {"new": True, "fields": LEASE_FIELDS, **limit},
    )
    return doc


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
