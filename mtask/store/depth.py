"""Queue depth for autoscaling: the pending tasks that are due now, per name, and when the
oldest of them became due.

One aggregation on the ``claim`` index (hinted: a partial index of open tasks only, ``name,
next_claim_at``), so it stays cheap however many finished tasks the collection holds. "Due" and
"age" are decided by the server's clock (``$$NOW``), never this host's.
"""

from __future__ import annotations

from typing import Any

from mtask.driver import Call, Op

Due = dict[str, tuple[int, float]]


DUE_PIPELINE: list[dict[str, Any]] = [
    {
        "$match": {
            "next_claim_at": {"$type": "date"},  # the claim index's partial filter
            "status": "pending",
            "$expr": {"$lte": ["$next_claim_at", "$$NOW"]},
        }
    },
    {
        "$group": {
            "_id": "$name",
            "n": {"$sum": 1},
            "age_ms": {"$max": {"$subtract": ["$$NOW", "$next_claim_at"]}},
        }
    },
]


def due() -> Op[Due]:
    """``{name: (pending tasks due now, seconds since the oldest of them became due)}``."""
    rows = yield Call("aggregate", (DUE_PIPELINE,), {"hint": "claim"})
    return {
        row["_id"]: (int(row["n"]), max(0.0, float(row["age_ms"]) / 1000))
        for row in rows
        if isinstance(row.get("_id"), str) and isinstance(row.get("age_ms"), int | float)
    }
