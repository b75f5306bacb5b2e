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
"""

from __future__ import annotations

import datetime as dt

from pymongo import ReturnDocument

from mtask.driver import Call, Doc, Op
from mtask.models import RunState, TaskStatus
from mtask.statemachine import RUNNING
from mtask.store.outcomes import Outcome, finish_update


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
