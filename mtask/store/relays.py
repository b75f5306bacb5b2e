"""The relay's lease: which worker process holds the one change stream and claim queue of a
tasks collection for every worker, on any host (``worker/finding/shared/relay``). MongoDB
alone decides, on its own clock: a lease document per tasks collection in ``relays``, taken or
renewed by one atomic update that matches only while the lease is the caller's or has run out.

The same document names the relay's *standby* (``worker/finding/shared/standby``): one worker
of another process that watches the lease, its post held while it renews it
(``standby_until``). The standby alone may take the lease over as soon as it has not been
renewed for a while (``watch``: a relay that died, froze or was cut off), long before it runs
out; anyone else waits until it has run out (``acquire``). A new relay starts without one.
"""

from __future__ import annotations

import datetime as dt
from typing import NamedTuple

from mtask.driver import MODIFY_ONCE, Call, Doc, Op

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


def _lease(tasks: str, relay: str, ttl_ms: int) -> tuple[Doc, list[Doc]]:
    """The filter and update of a take or renewal of the lease (``acquire``, ``renew``)."""
    return (
        {
            "_id": tasks,
            "$or": [{"relay": relay}, {"$expr": {"$lte": ["$expires_at", "$$NOW"]}}],
        },
        [
            {
                "$set": {
                    "standby": {"$cond": [{"$eq": ["$relay", relay]}, "$standby", None]},
                    "standby_until": {
                        "$cond": [{"$eq": ["$relay", relay]}, "$standby_until", NOBODY]
                    },
                    "relay": relay,
                    "expires_at": {"$add": ["$$NOW", ttl_ms]},
                }
            }
        ],
    )


def acquire(tasks: str, relay: str, ttl_ms: int) -> Op[bool]:
    """Take the lease of ``tasks`` for ``relay`` (one relay's unique id), or renew it, until
    ``ttl_ms`` from now by the server's clock. True if ``relay`` holds it now (an update that
    returns no document: whether it matched is the answer)."""
    result = yield Call("update_one", _lease(tasks, relay, ttl_ms), collection=COLLECTION)
    return bool(result.matched_count)


class Renewal(NamedTuple):
    """A renewed lease, and its standby's post."""

    standby: str | None
    """The worker id that holds the post, or last held it."""
    watched: bool
    """Whether that worker still holds the post (renewed it within its time, by the server's
    clock): it may take the lease over once the relay stops renewing."""


def renew(tasks: str, relay: str, ttl_ms: int) -> Op[Renewal | None]:
    """``acquire``, saying who stands by (``None``: ``relay`` does not hold the lease). A relay
    that takes the lease from another starts without a standby.

    Not a retryable write (``MODIFY_ONCE``: no image of the document kept on the server): the
    relay renews every few seconds, a renewal that failed is sent again at the next, and renewing
    a lease twice is renewing it once."""
    held: Doc | None = yield Call(
        MODIFY_ONCE,
        _lease(tasks, relay, ttl_ms),
        {"new": True, "fields": {"standby": 1, "watched": {"$gt": ["$standby_until", "$$NOW"]}}},
        collection=COLLECTION,
    )
    if held is None:
        return None
    standby = held.get("standby")
    return Renewal(standby if isinstance(standby, str) else None, held.get("watched") is True)


def stand_by(tasks: str, relay: str, standby: str, ttl_ms: int) -> Op[bool]:
    """Take or renew the post of ``relay``'s standby for the worker ``standby``, until ``ttl_ms``
    from now: only while ``relay`` holds the lease and the post is free, run out, or already
    ``standby``'s. True if ``standby`` holds it now."""
    result = yield Call(
        "update_one",
        (
            {
                "_id": tasks,
                "relay": relay,
                "$or": [
                    {"standby": standby},
                    {"$expr": {"$not": [{"$gt": ["$standby_until", "$$NOW"]}]}},
                ],
            },
            [{"$set": {"standby": standby, "standby_until": {"$add": ["$$NOW", ttl_ms]}}}],
        ),
        collection=COLLECTION,
    )
    return bool(result.matched_count)


class Watch(NamedTuple):
    """What the standby's look at the lease found (``watch``)."""

    taken: bool
    """Whether it took the lease over (for its new relay)."""
    ago_ms: int
    """Milliseconds since the relay last renewed the lease, by the server's clock (0 if taken)."""


def watch(
    tasks: str, relay: str, standby: str, new_relay: str, stale_ms: int, ttl_ms: int, post_ms: int
) -> Op[Watch | None]:
    """The standby ``standby``'s one command at each look at ``relay``'s lease: one atomic update
    that takes the lease over for ``new_relay`` if ``relay`` has not renewed it for ``stale_ms``
    (its renewals set its end ``ttl_ms`` ahead), else renews the post for ``post_ms`` (once half
    of it is left) and says how long ago the relay renewed, all by the server's clock. ``None``
    once the post or the lease is another's (nothing matches)."""
    renewed_at = {"$subtract": ["$expires_at", ttl_ms]}
    # (an end of any other shape is never taken over: ``$cond`` reads it first)
    silent = {
        "$cond": [
            {"$eq": [{"$type": "$expires_at"}, "date"]},
            {"$lte": [renewed_at, {"$subtract": ["$$NOW", stale_ms]}]},
            False,
        ]
    }
    # the post renewed once half of it is left: the other looks write nothing (a no-op update
    # leaves no oplog entry to wake every change stream)
    half_left = {"$lt": ["$standby_until", {"$add": ["$$NOW", post_ms // 2]}]}
    post = {"$cond": [half_left, {"$add": ["$$NOW", post_ms]}, "$standby_until"]}
    held: Doc | None = yield Call(
        "find_one_and_update",
        (
            {"_id": tasks, "relay": relay, "standby": standby},
            [
                {
                    "$set": {
                        "relay": {"$cond": [silent, {"$literal": new_relay}, "$relay"]},
                        "expires_at": {
                            "$cond": [silent, {"$add": ["$$NOW", ttl_ms]}, "$expires_at"]
                        },
                        "standby": {"$cond": [silent, None, "$standby"]},
                        "standby_until": {"$cond": [silent, NOBODY, post]},
                    }
                }
            ],
        ),
        {
            "projection": {
                "_id": 0,
                "relay": 1,
                "ago": {
                    "$cond": [
                        {"$eq": [{"$type": "$expires_at"}, "date"]},
                        {"$subtract": [{"$add": ["$$NOW", ttl_ms]}, "$expires_at"]},
                        None,
                    ]
                },
            },
            "return_document": True,
        },
        collection=COLLECTION,
    )
    if held is None:
        return None
    if held.get("relay") == new_relay:
        return Watch(True, 0)
    ago = held.get("ago")
    ago_ms = int(ago) if isinstance(ago, int | float) and not isinstance(ago, bool) else 0
    return Watch(False, ago_ms)


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
