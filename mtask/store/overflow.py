"""Lossy limits: a task a full limit refused, dropped or failed at once instead of
waiting for a slot (``set_limit(..., overflow="drop" | "fail")``).

The refusal is the server's (the slot's take, ``mtask.limits.slots``); the drop is then one update
of the task, fenced: it is still pending and due at the take's time, with no run RUNNING, so a task
another worker claimed meanwhile, or one moved later, is left alone. ``drop`` cancels it,
``fail`` fails it for good (``failed_permanently``: no retry); both say why in ``error``.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence

from mtask.driver import Call, Op
from mtask.statemachine import RUNNING, recompute_stages
from mtask.store.schema import WELL_FORMED, literal
from mtask.vocabulary import TaskStatus

OVERFLOWS = ("queue", "drop", "fail")
"""What a full limit does with the excess: ``queue`` (the default: it waits for a slot), or
``drop`` (cancelled) or ``fail`` (failed for good) at once."""


def shed(keys: Sequence[str], how: str, why: str, now: dt.datetime) -> Op[int]:
    """Drop (``how`` ``"drop"``) or fail (``"fail"``) the pending ``keys`` a full limit refused
    at ``now``, saying ``why``; returns how many were."""
    if not keys or how not in ("drop", "fail"):
        return 0
    sets: dict[str, object] = {"error": literal(why)}
    if how == "drop":
        sets["status"] = TaskStatus.CANCELLED.value
    else:
        sets["failed_permanently"] = True
    result = yield Call(
        "update_many",
        (
            {
                "_id": {"$in": list(keys)},
                "status": TaskStatus.PENDING.value,
                "next_claim_at": {"$type": "date", "$lte": now},
                "runs": {"$not": {"$elemMatch": {"state": RUNNING}}},
                **WELL_FORMED,
            },
            [{"$set": sets}, *recompute_stages(now)],
        ),
    )
    return int(result.modified_count)
