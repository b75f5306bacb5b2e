"""Task documents a test writes by hand, and the clock they are dated by."""

from __future__ import annotations

import datetime as dt
from typing import Any

T0 = dt.datetime(2046, 3, 1, 12, 0, tzinfo=dt.UTC)
"""The start of an injected clock (``FixedClock``) in tests that do not wait. In the future:
a task finished at T0 expires (``expire_at``) after it, so MongoDB's TTL monitor, which goes
by the server's real clock, never removes a test's task while the test reads it."""


def pad_to_the_limit(collection: Any, key: str, short: int) -> None:
    """Pad task ``key``'s document (unknown fields are kept) to ``short`` bytes short of
    16 MiB, in two writes of half each (one write near 16 MiB strains a small cache)."""
    collection.update_one({"_id": key}, {"$set": {"padding": "", "more_padding": ""}})
    [size] = collection.aggregate(
        [{"$match": {"_id": key}}, {"$project": {"s": {"$bsonSize": "$$ROOT"}}}]
    )
    pad = 16 * 1024 * 1024 - short - size["s"]
    for half, length in (("padding", pad // 2), ("more_padding", pad - pad // 2)):
        collection.update_one({"_id": key}, {"$set": {half: "p" * length}})


def hand_written(now: dt.datetime, **fields: Any) -> dict[str, Any]:
    """A well-formed pending ``add`` task document as a service writes it by hand (no ``_id``
    unless given in ``fields``, which override what they name)."""
    return {
        "name": "add",
        "status": "pending",
        "next_claim_at": now,
        "available_at": now,
        "runs": [],
        "successes": 0,
        "failures": 0,
        "attempts": 0,
        "params": {"a": 1, "b": 1},
        "options": {
            "specific_worker_ids": [],
            "concurrency": 1,
            "max_retries": 1,
            "worker_timeout_ms": 1000,
            "ping_interval_ms": 100,
        },
        **fields,
    }


def in_groups(
    name: str, prefix: str, groups: int, each: int, params: dict[str, Any]
) -> list[dict[str, Any]]:
    """``each`` tasks ``name`` in each of ``groups`` groups (``{prefix}{g}``), keyed
    ``{prefix}{g}/{i:02d}``, for ``publish_many``: the groups' tasks interleaved."""
    return [
        {"name": name, "key": f"{prefix}{g}/{i:02d}", "params": params,
         "options": {"group": f"{prefix}{g}"}}
        for i in range(each)
        for g in range(groups)
    ]  # fmt: skip
