"""The task state machine: pure rules, and the same rules as MongoDB pipeline expressions.

Every transition is one atomic update whose pipeline ends with ``recompute_stages(now)``, so
``status`` and ``next_claim_at`` are always in step with ``runs`` and the counters. The Python
functions here are the specification: property tests check them, and a test on the real server
checks that the pipeline expressions agree with them.

Rules (``now`` is always the MongoDB server's time, see ``mtask.clock``):

* status: ``cancelled`` and ``invalid`` are sticky (``STICKY``: only ``retry`` of a cancelled
  task, or a publish that resets the task, sets another); else ``succeeded`` when
  ``successes >= concurrency``; else ``failed`` when ``failed_permanently`` or
  ``failures > max_retries``; else ``running`` when a run is RUNNING; else ``pending``.
* next_claim_at: ``None`` once finished, and while ``waiting_on`` lists dependencies; else
  ``available_at`` while fewer than ``concurrency`` slots are taken (RUNNING + SUCCESS); else
  ``max(available_at, earliest RUNNING lease)`` — the moment a lease can expire and the task be
  preempted.
"""

from __future__ import annotations

import datetime as dt
import random
from collections.abc import Mapping, Sequence
from typing import Any

from mtask.vocabulary import (
    DEFAULT_KEEP_MS,
    KEEP_FIELDS,
    MAX_KEEP_MS,
    MAX_RUNS_KEPT,
    RunState,
    TaskStatus,
)

Doc = Mapping[str, Any]
RUNNING = RunState.RUNNING.value

# ---------------------------------------------------------------------------------------------
# Pure rules
# ---------------------------------------------------------------------------------------------


STICKY = (TaskStatus.CANCELLED.value, TaskStatus.INVALID.value)
"""Statuses no run's outcome changes: a cancelled task stays cancelled, and one marked invalid
(``store.quarantine``, which may mark a running task) is not revived by the outcome of a run
that was in flight, whose counters were judged from fields found malformed."""


def derive_status(doc: Doc) -> TaskStatus:
    if doc.get("status") in STICKY:
        return TaskStatus(doc["status"])
    options = doc["options"]
    if doc.get("successes", 0) >= options["concurrency"]:
        return TaskStatus.SUCCEEDED
    if doc.get("failed_permanently") or doc.get("failures", 0) > options["max_retries"]:
        return TaskStatus.FAILED
    if any(r["state"] == RUNNING for r in doc.get("runs", ())):
        return TaskStatus.RUNNING
    return TaskStatus.PENDING


def compute_next_claim_at(doc: Doc, status: TaskStatus) -> dt.datetime | None:
    if status.finished or doc.get("waiting_on"):
        return None
    available: dt.datetime = doc["available_at"]
    leases = [r["lease_expires_at"] for r in doc.get("runs", ()) if r["state"] == RUNNING]
    if len(leases) + doc.get("successes", 0) < doc["options"]["concurrency"]:
        return available
    latest: dt.datetime = max(available, min(leases))
    return latest


def keep_ms(options: Doc, status: TaskStatus | str) -> int | None:
    """How long a task finished with ``status`` is kept (ms), ``None`` for forever: its own
    ``options.keep_<status>_ms`` if it is a number no larger than ``MAX_KEEP_MS`` (a negative
    one: forever), else the built-in default: a document edited by hand with ``1e15``, infinity
    or NaN there is kept as by default, not past the dates a driver can read (``_keep_expr``
    says the same on the server)."""
    status = str(status)
    if status not in KEEP_FIELDS:
        return None
    value = options.get(KEEP_FIELDS[status]) if isinstance(options, Mapping) else None
    if not isinstance(value, int | float) or isinstance(value, bool) or not value <= MAX_KEEP_MS:
        value = DEFAULT_KEEP_MS[status]  # ``not <=``: NaN too
    return None if value < 0 else int(value)


def compute_expire_at(doc: Doc, status: TaskStatus) -> dt.datetime | None:
    """``finished_at`` + the retention of ``status``; ``None`` while open, for a task kept
    forever, and for a flow parent with steps (held until they are finished, see
    ``mtask.store.retention.release_parents``)."""
    finished_at = doc.get("finished_at")
    if not status.finished or doc.get("children") or not isinstance(finished_at, dt.datetime):
        return None
    keep = keep_ms(doc.get("options") or {}, status)
    return None if keep is None else finished_at + dt.timedelta(milliseconds=keep)


def backoff_ms(
    failures: int,
    *,
    retry_delay_ms: int,
    retry_backoff: float,
    max_retry_delay_ms: int,
    jitter: float = 0.2,
    rng: random.Random | None = None,
) -> int:
    """Delay before retry number ``failures`` (1-based): exponential, capped, with +/- jitter.

    The result always lies in ``[0, max_retry_delay_ms]``.
    """
    exponent = max(0, failures - 1)
    try:
        base = retry_delay_ms * retry_backoff**exponent
    except OverflowError:
        base = float(max_retry_delay_ms)
    base = min(base, float(max_retry_delay_ms))
    spread = (rng or random).uniform(-jitter, jitter)
    return max(0, min(max_retry_delay_ms, round(base * (1.0 + spread))))


# ---------------------------------------------------------------------------------------------
# The same rules as aggregation expressions, for pipeline updates
# ---------------------------------------------------------------------------------------------


def _running_runs() -> dict[str, Any]:
    return {"$filter": {"input": "$runs", "as": "r", "cond": {"$eq": ["$$r.state", RUNNING]}}}


STATUS_EXPR: dict[str, Any] = {
    "$switch": {
        "branches": [
            {"case": {"$in": ["$status", list(STICKY)]}, "then": "$status"},
            {
                "case": {"$gte": ["$successes", "$options.concurrency"]},
                "then": TaskStatus.SUCCEEDED.value,
            },
            {
                "case": {
                    "$or": [
                        {"$eq": ["$failed_permanently", True]},
                        {"$gt": ["$failures", "$options.max_retries"]},
                    ]
                },
                "then": TaskStatus.FAILED.value,
            },
            {
                "case": {"$gt": [{"$size": _running_runs()}, 0]},
                "then": TaskStatus.RUNNING.value,
            },
        ],
        "default": TaskStatus.PENDING.value,
    }
}

NEXT_CLAIM_EXPR: dict[str, Any] = {
    "$cond": [
        {
            "$and": [
                {"$in": ["$status", [s.value for s in (TaskStatus.PENDING, TaskStatus.RUNNING)]]},
                # waiting for dependencies: not claimable until the last one succeeded
                {"$eq": [{"$size": {"$ifNull": ["$waiting_on", []]}}, 0]},
            ]
        },
        {
            "$let": {
                "vars": {"running": _running_runs()},
                "in": {
                    "$cond": [
                        {
                            "$lt": [
                                {"$add": [{"$size": "$$running"}, "$successes"]},
                                "$options.concurrency",
                            ]
                        },
                        "$available_at",
                        {"$max": ["$available_at", {"$min": "$$running.lease_expires_at"}]},
                    ]
                },
            }
        },
        None,
    ]
}


def fold_runs_expr(limit: int = MAX_RUNS_KEPT) -> dict[str, Any]:
    """Keep every RUNNING run and the newest finished ones, at most ``limit`` entries in all
    (unless more than ``limit`` are RUNNING); count what is dropped in ``runs_folded``."""
    done = {"$filter": {"input": "$runs", "as": "r", "cond": {"$ne": ["$$r.state", RUNNING]}}}
    return {
        "$let": {
            "vars": {"running": _running_runs(), "done": done},
            "in": {
                "$let": {
                    "vars": {
                        "keep": {
                            "$min": [
                                {"$size": "$$done"},
                                {"$max": [0, {"$subtract": [limit, {"$size": "$$running"}]}]},
                            ]
                        }
                    },
                    "in": {
                        "runs": {
                            "$concatArrays": [
                                {
                                    "$cond": [
                                        {"$gt": ["$$keep", 0]},
                                        {"$lastN": {"input": "$$done", "n": "$$keep"}},
                                        [],
                                    ]
                                },
                                "$$running",
                            ]
                        },
                        "dropped": {"$subtract": [{"$size": "$$done"}, "$$keep"]},
                    },
                }
            },
        }
    }


def _keep_expr() -> dict[str, Any]:
    """Expression: ``keep_ms`` of ``$status`` from the document's own options (-1: forever)."""
    branches = []
    for status, default in DEFAULT_KEEP_MS.items():
        own = f"$options.{KEEP_FIELDS[status]}"
        usable = {
            "$and": [
                {"$in": [{"$type": own}, ["int", "long", "double"]]},  # as Python's int | float
                {"$lte": [own, MAX_KEEP_MS]},
                {"$gte": [own, float("-inf")]},  # not NaN (which sorts below every number)
            ]
        }
        value = {"$cond": [usable, own, default]}
        branches.append({"case": {"$eq": ["$status", status]}, "then": value})
    return {"$switch": {"branches": branches, "default": -1}}


def expire_fields(now: dt.datetime | str) -> dict[str, Any]:
    """``$set`` fields (after ``status`` is derived): ``expire_at`` as ``compute_expire_at``
    says, and ``expire_held`` on a finished flow parent whose retention waits for its steps.
    Both are removed while the task is open."""
    finished = {"$ifNull": ["$finished_at", now]}
    is_open = {"$in": ["$status", list(OPEN)]}
    has_steps = {"$gt": [{"$size": {"$ifNull": ["$children", []]}}, 0]}
    return {
        "expire_at": {
            "$let": {
                "vars": {"keep": _keep_expr()},
                "in": {
                    "$cond": [
                        {"$or": [is_open, has_steps, {"$lt": ["$$keep", 0]}]},
                        "$$REMOVE",
                        {"$add": [finished, {"$toLong": "$$keep"}]},
                    ]
                },
            }
        },
        "expire_held": {"$cond": [{"$and": [{"$not": [is_open]}, has_steps]}, True, "$$REMOVE"]},
    }


def live_run_expr(now: dt.datetime | str) -> dict[str, Any]:
    """Whether the task has a RUNNING run whose lease has not ended at ``now``."""
    return {
        "$anyElementTrue": [
            {
                "$map": {
                    "input": {"$ifNull": ["$runs", []]},
                    "as": "r",
                    "in": {
                        "$and": [
                            {"$eq": ["$$r.state", RUNNING]},
                            {"$gt": ["$$r.lease_expires_at", now]},
                        ]
                    },
                }
            }
        ]
    }


def lock_kept_expr(now: dt.datetime | str) -> dict[str, Any]:
    """A sequence's lock (``group_lock``) stays with its task while the task is open, or while
    a run of it still runs on a live lease (a cancelled task's handler that has not stopped
    yet: docs/flow-control.md); it goes with the write that ends the last of them. A task that
    holds none is left as it is (one comparison)."""
    keep = {"$or": [{"$in": ["$status", list(OPEN)]}, live_run_expr(now)]}
    return {
        "$cond": [
            {"$eq": ["$group_lock", True]},
            {"$cond": [keep, True, "$$REMOVE"]},
            "$$REMOVE",
        ]
    }


def recompute_stages(now: dt.datetime | str) -> list[dict[str, Any]]:
    """Pipeline stages that end every transition: fold old runs, then derive ``status``,
    ``next_claim_at``, ``finished_at``, ``expire_at`` and whether a sequence's lock stays
    (``lock_kept_expr``) from the fields the earlier stages set. ``now`` is the server's time
    as a value, or ``"$$NOW"``."""
    folded = fold_runs_expr()
    return [
        {"$set": {"_fold": folded}},
        {
            "$set": {
                "runs": "$_fold.runs",
                "runs_folded": {"$add": [{"$ifNull": ["$runs_folded", 0]}, "$_fold.dropped"]},
                "status": STATUS_EXPR,
                "updated_at": now,
            }
        },
        {"$unset": "_fold"},
        {
            "$set": {
                "next_claim_at": NEXT_CLAIM_EXPR,
                "finished_at": {
                    "$cond": [
                        {"$in": ["$status", list(OPEN)]},
                        None,
                        {"$ifNull": ["$finished_at", now]},
                    ]
                },
                **expire_fields(now),
                "group_lock": lock_kept_expr(now),
            }
        },
    ]


OPEN = (TaskStatus.PENDING.value, TaskStatus.RUNNING.value)


def set_run_fields(run_id: str | Sequence[str], fields: Mapping[str, Any]) -> dict[str, Any]:
    """Expression: ``runs`` with the run ``run_id`` (or any run whose id is in a list of them)
    merged with ``fields``."""
    ours = (
        {"$eq": ["$$r.run_id", run_id]}
        if isinstance(run_id, str)
        else {"$in": ["$$r.run_id", {"$literal": list(run_id)}]}
    )
    return {
        "$map": {
            "input": "$runs",
            "as": "r",
            "in": {
                "$cond": [
                    ours,
                    {"$mergeObjects": ["$$r", dict(fields)]},
                    "$$r",
                ]
            },
        }
    }


def _expired(now: dt.datetime) -> dict[str, Any]:
    """Condition on ``$$r``: a RUNNING run whose lease ended by ``now``."""
    return {"$and": [{"$eq": ["$$r.state", RUNNING]}, {"$lte": ["$$r.lease_expires_at", now]}]}


def expire_leases_expr(now: dt.datetime) -> dict[str, Any]:
    """Expression: ``runs`` with every RUNNING run whose lease ended by ``now`` made TIMEOUT."""
    expired = _expired(now)
    return {
        "$map": {
            "input": "$runs",
            "as": "r",
            "in": {
                "$cond": [
                    expired,
                    {
                        "$mergeObjects": [
                            "$$r",
                            {
                                "state": RunState.TIMEOUT.value,
                                "finished_at": now,
                                "error": "lease expired: the worker stopped pinging",
                            },
                        ]
                    },
                    "$$r",
                ]
            },
        }
    }


def count_expired_expr(now: dt.datetime) -> dict[str, Any]:
    return {"$size": {"$filter": {"input": "$runs", "as": "r", "cond": _expired(now)}}}


def live_runs_expr(now: dt.datetime, runs: str | Sequence[Any] = "$runs") -> dict[str, Any]:
    """Expression: RUNNING runs whose lease has not ended by ``now``."""
    return {
        "$filter": {
            "input": runs,
            "as": "r",
            "cond": {
                "$and": [{"$eq": ["$$r.state", RUNNING]}, {"$gt": ["$$r.lease_expires_at", now]}]
            },
        }
    }
