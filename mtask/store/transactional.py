"""The SUCCESS of a transactional run, written in the handler's own transaction.

``complete_in_transaction`` is the single-task SUCCESS update of ``outcomes.finish_update`` (the
same run fields, result, ``Next`` steps and stage recomputation) with a stronger filter: the run
is still RUNNING, the task is ``running``, and the run's lease has not expired on the server's
clock (``lease_expires_at > $$NOW``). Run in the transaction that holds the handler's writes, it
is the fence of all of them: no match (``None``) means the run lost the task, and the caller
aborts so that none of the handler's writes land.

The fence is a write on the task document, not a read: a takeover that claims the task after
this transaction's snapshot changes the document, so this update meets a ``WriteConflict`` (a
``TransientTransactionError``) and the transaction aborts, even if the zombie read the fence
before the takeover. Read-only fences would not conflict.

``begin_run_transaction`` and ``kill_sessions`` keep a dead or frozen run's open transaction from
blocking the run that takes its task over (docs/transactions.md, "Under faults"). Before its
transaction starts, a run writes its session's id (``lsid``) into its run entry, fenced like
every run write (``txn``; the session of its live output's transactions: ``output_txn``); a
run that takes the task over kills the sessions of the earlier runs whose
lease expired (``killSessions``), which aborts their transactions at once. Without it the server
keeps such a transaction, and the locks its writes hold, until ``transactionLifetimeLimitSeconds``
(60 s by default; the reaper ran up to ~30 s later in the runs observed), and every other
transaction writing the same documents meets a ``WriteConflict`` until then.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from pymongo import ReturnDocument

from mtask.driver import Call, Doc, Op
from mtask.statemachine import RUNNING
from mtask.store.claims import lease_update
from mtask.store.outcomes import Outcome, finish_update
from mtask.store.schema import literal
from mtask.vocabulary import RunState, TaskStatus


def lease_alive_expr(run_id: str) -> Doc:
    """True when the task holds run ``run_id``, RUNNING, with a lease that ends after the
    server's ``$$NOW``."""
    return {
        "$anyElementTrue": [
            {
                "$map": {
                    "input": {"$ifNull": ["$runs", []]},
                    "in": {
                        "$and": [
                            {"$eq": ["$$this.run_id", run_id]},
                            {"$eq": ["$$this.state", RUNNING]},
                            {"$gt": ["$$this.lease_expires_at", "$$NOW"]},
                        ]
                    },
                }
            }
        ]
    }


def run_fence(key: str, run_id: str, **also: Any) -> Doc:
    """The filter of a run's own writes (its steps, its output): its task ``running``, the run
    RUNNING (with ``also`` on its entry) and its lease unexpired on the server's clock."""
    fenced: Doc = {
        "_id": key,
        "status": TaskStatus.RUNNING.value,
        "runs": {"$elemMatch": {"run_id": run_id, "state": RUNNING, **also}},
        "$expr": lease_alive_expr(run_id),
    }
    return fenced


def complete_filter_and_pipeline(outcome: Outcome, now: dt.datetime) -> tuple[Doc, list[Doc]]:
    """``finish_update``'s SUCCESS with the transactional fence added to its filter."""
    if outcome.state is not RunState.SUCCESS:
        raise ValueError("a transactional completion records a SUCCESS only")
    filt, pipeline = finish_update(outcome, now)
    fenced = {
        **filt,
        "status": TaskStatus.RUNNING.value,
        "$expr": lease_alive_expr(outcome.run_id),
    }
    return fenced, pipeline


def complete_in_transaction(outcome: Outcome, now: dt.datetime) -> Op[Doc | None]:
    """Record ``outcome`` (a SUCCESS) if its run still owns the task; run it with the handler's
    session, inside its transaction. Returns the task after the update, or ``None``: the run
    lost the task, abort the transaction."""
    filt, pipeline = complete_filter_and_pipeline(outcome, now)
    doc: Doc | None = yield Call(
        "find_one_and_update", (filt, pipeline), {"return_document": ReturnDocument.AFTER}
    )
    return doc


KILL_TIMEOUT_S = 5.0
"""The most finding and killing stale transactions may take (a read and a command that wait
for nothing; bounded all the same, since they run when MongoDB may be in trouble)."""

TXN_FIELD = "txn"
"""The run entry's field holding the id (``lsid.id``, a UUID) of its transaction's session."""
OUTPUT_TXN_FIELD = "output_txn"
"""The run entry's field holding the id of the session its live output's transactions use
(``store.output.record_session``): a field of its own, since a transactional step sets and
clears ``txn`` while the run's output goes on."""
SESSION_FIELDS = (TXN_FIELD, OUTPUT_TXN_FIELD)
"""The run entry's fields that may name a session with a transaction open on the server."""


def begin_run_transaction(
    key: str, run_id: str, worker_id: str, now: dt.datetime, session_uuid: Any
) -> Op[bool]:
    """Before the run's transaction starts: a ping (``lease_update``: the same fence, the lease
    pushed to ``now + worker_timeout_ms``) that also writes the session id into the run entry.
    The worker does not ping the run while its transaction is open (a ping would make the
    fenced SUCCESS a write conflict), so the transaction must end within this lease. ``False``:
    the run lost the task, do not start the transaction. A retryable write, unlike a ping:
    nothing sends it again, and a transient error here would fail the run (an ``update_one``:
    whether it matched is all the caller needs)."""
    result = yield Call(
        "update_one",
        lease_update(key, run_id, worker_id, now, {TXN_FIELD: literal(session_uuid)}),
    )
    return bool(result.matched_count)


def stale_sessions(runs: Any, run_id: str) -> list[Any]:
    """The session ids of the earlier runs in ``runs`` (a claimed document's) whose lease
    expired: their transactions may still be open on the server."""
    return [
        r[field]
        for r in runs or ()
        if isinstance(r, dict)
        and r.get("run_id") != run_id
        and r.get("state") == RunState.TIMEOUT.value
        for field in SESSION_FIELDS
        if r.get(field) is not None
    ]


def expired_transactions(keys: list[str], now: dt.datetime) -> Op[list[Any]]:
    """The session ids of the RUNNING runs among ``keys`` whose lease ended by ``now`` and
    that recorded a transaction: a claim taking such a task over waits if the transaction wrote
    its document and is still open (read without waiting: a read outside a transaction sees the
    last committed version)."""
    recorded = [{field: {"$ne": None}} for field in SESSION_FIELDS]
    expired = {"state": RUNNING, "lease_expires_at": {"$lte": now}, "$or": recorded}
    shown = {"runs.state": 1, "runs.lease_expires_at": 1}
    docs: list[Doc] = yield Call(
        "find",
        (
            {"_id": {"$in": list(keys)}, "runs": {"$elemMatch": expired}},
            {**shown, **{f"runs.{field}": 1 for field in SESSION_FIELDS}},
        ),
        timeout=KILL_TIMEOUT_S,
    )
    return [
        r[field]
        for doc in docs
        for r in doc.get("runs") or ()
        if isinstance(r, dict)
        and r.get("state") == RUNNING
        and isinstance(r.get("lease_expires_at"), dt.datetime)
        and r["lease_expires_at"] <= now
        for field in SESSION_FIELDS
        if r.get(field) is not None
    ]


def kill_sessions(session_uuids: list[Any]) -> Op[None]:
    """Kill these sessions: the server aborts their open transactions and interrupts their
    operations (a session of another MongoDB user is left alone: ``killSessions`` reaches the
    caller's own sessions only, unless it has the ``killAnySession`` privilege)."""
    if session_uuids:
        kill = ("killSessions", [{"id": u} for u in session_uuids])
        yield Call("command", kill, timeout=KILL_TIMEOUT_S)
