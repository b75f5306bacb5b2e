"""The relay's lease: which worker process holds the one change stream and claim queue of a
tasks collection for every worker, on any host (``worker/finding/shared/relay``). MongoDB
alone decides, on its own clock: a lease document per tasks collection in ``relays``, taken or
renewed by one atomic update that matches only while the lease is the caller's or has run out.
"""

from __future__ import annotations

import datetime as dt

from mtask.driver import Call, Doc, Op

COLLECTION = "relays"
NOBODY = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
"""The end of a lease nobody holds."""


def ensure(tasks: str) -> Op[None]:
    """The lease document of ``tasks``, created if missing (an upsert on ``_id``: the server
    retries one that races another)."""
    yield Call(
        "update_one",
        ({"_id": tasks}, {"$setOnInsert": {"relay": None, "expires_at": NOBODY}}),
        {"upsert": True},
        collection=COLLECTION,
    )


def acquire(tasks: str, relay: str, ttl_ms: int) -> Op[bool]:
    """Take the lease of ``tasks`` for ``relay`` (one relay's unique id), or renew it, until
    ``ttl_ms`` from now by the server's clock. True if ``relay`` holds it now."""
    held: Doc | None = yield Call(
        "find_one_and_update",
        (
            {
                "_id": tasks,
                "$or": [{"relay": relay}, {"$expr": {"$lte": ["$expires_at", "$$NOW"]}}],
            },
            [{"$set": {"relay": relay, "expires_at": {"$add": ["$$NOW", ttl_ms]}}}],
        ),
        {"projection": {"relay": 1}},
        collection=COLLECTION,
    )
    return held is not None


def holder(tasks: str) -> Op[str | None]:
    """The relay whose lease of ``tasks`` has not run out, if any."""
    docs: list[Doc] = yield Call(
        "find",
        ({"_id": tasks, "$expr": {"$gt": ["$expires_at", "$$NOW"]}}, {"relay": 1}),
        collection=COLLECTION,
    )
    relay = docs[0].get("relay") if docs else None
    return relay if isinstance(relay, str) else None


def renewed_ago(tasks: str, relay: str, ttl_ms: int) -> Op[int | None]:
    """Milliseconds since ``relay`` last renewed its lease of ``tasks``, on the server's clock
    (its renewals set the end ``ttl_ms`` ahead); ``None`` if the lease is not its own or has run
    out. A relay that stopped renewing (dead, frozen, cut off) is found out before its lease runs
    out, and how late it is tells a subscriber when to look again."""
    docs: list[Doc] = yield Call(
        "find",
        (
            {
                "_id": tasks,
                "relay": relay,
                "expires_at": {"$type": "date"},
                "$expr": {"$gt": ["$expires_at", "$$NOW"]},
            },
            {"_id": 0, "ago": {"$subtract": [{"$add": ["$$NOW", ttl_ms]}, "$expires_at"]}},
        ),
        collection=COLLECTION,
    )
    ago = docs[0].get("ago") if docs else None
    return int(ago) if isinstance(ago, int | float) and not isinstance(ago, bool) else None


def release(tasks: str, relay: str) -> Op[None]:
    """End ``relay``'s lease now (a relay that stops): another may take it at once."""
    yield Call(
        "update_one",
        ({"_id": tasks, "relay": relay}, {"$set": {"expires_at": NOBODY}}),
        collection=COLLECTION,
    )
