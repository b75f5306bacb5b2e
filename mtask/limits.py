"""Cluster-wide limits per task name: at most N runs at once, at most R claims per second.

One document per limited name in the ``limits`` collection holds both the limit and its state::

    {_id: name, concurrency: N | null, rate: per second | null, burst: tokens | null,
     holders: [{run_id, key, worker_id, expires}], tokens: float, refilled_at: date}

A worker takes a slot (and a token) with one atomic update of that document *before* it claims
a task of that name, and claims the task with the run id the slot was taken for; a claim that
misses gives the slot back. A slot is a lease like the run's: it carries ``expires`` (server
time), the lease pinger extends it with the run's lease, and a slot whose worker died simply
runs out. The token bucket is refilled from the server clock inside the same update. No limit is
ever kept in a single worker's memory: workers only cache *which* names are limited (refreshed
on a change event for a name not known as limited, and every 5 s), to know when to take a slot.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Sequence
from dataclasses import dataclass

from pymongo import ReturnDocument

from mtask.driver import Call, Doc, Op
from mtask.errors import InvalidTask
from mtask.models import validate_name

MAX_LIMIT_CONCURRENCY = 1_000_000
MAX_RATE = 1_000_000.0

# ---------------------------------------------------------------------------------------------
# Pure rules (property-tested); the pipeline below computes the same on the server
# ---------------------------------------------------------------------------------------------


def refill(
    tokens: float, refilled_at: dt.datetime, now: dt.datetime, rate: float, burst: float
) -> float:
    """Tokens in the bucket at ``now``: ``rate`` per second since ``refilled_at``, at most
    ``burst``. A clock that went back (another worker's ``now`` a millisecond behind) adds
    nothing and takes nothing."""
    elapsed_ms = max(0.0, (now - refilled_at).total_seconds() * 1000)
    return min(burst, tokens + elapsed_ms * rate / 1000)


def wait_for_token(tokens: float, rate: float) -> float:
    """Seconds until the bucket holds one token, given ``tokens`` now."""
    return 0.0 if tokens >= 1 else (1 - tokens) / rate


def validate_limit(
    name: object, concurrency: int | None, rate: float | None, burst: int | None
) -> tuple[str, int | None, float | None, int | None]:
    """Check a limit before anything is written; the error names the bad field."""
    name = validate_name(name)
    if concurrency is None and rate is None:
        raise InvalidTask("give concurrency, rate or both", field="limit")
    if concurrency is not None and (
        isinstance(concurrency, bool)
        or not isinstance(concurrency, int)
        or not 1 <= concurrency <= MAX_LIMIT_CONCURRENCY
    ):
        raise InvalidTask(
            f"must be an integer from 1 to {MAX_LIMIT_CONCURRENCY}", field="concurrency"
        )
    if rate is not None and (
        isinstance(rate, bool)
        or not isinstance(rate, int | float)
        or not math.isfinite(rate)
        or not 0 < rate <= MAX_RATE
    ):
        raise InvalidTask(
            f"must be a number above 0 and at most {MAX_RATE:g} per second", field="rate"
        )
    if burst is not None:
        if rate is None:
            raise InvalidTask("applies only with a rate", field="burst")
        if isinstance(burst, bool) or not isinstance(burst, int) or not 1 <= burst <= MAX_RATE:
            raise InvalidTask("must be an integer of at least 1", field="burst")
    return name, concurrency, None if rate is None else float(rate), burst


def parse_rate(text: str) -> float:
    """``"10/s"``, ``"600/m"``, ``"3600/h"`` or a plain number per second."""
    value, _, unit = text.strip().partition("/")
    seconds = {"": 1, "s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600}.get(unit.strip().lower())
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if seconds is None or not math.isfinite(number) or number <= 0:
        raise InvalidTask(f"{text!r} is not a rate like 10/s, 600/m or 3600/h", field="rate")
    return number / seconds


# ---------------------------------------------------------------------------------------------
# Operations on the limits collection
# ---------------------------------------------------------------------------------------------

CONFIG_FIELDS = {"concurrency": 1, "rate": 1, "burst": 1}


def set_limit(
    name: str, concurrency: int | None, rate: float | None, burst: int | None, now: dt.datetime
) -> Op[Doc]:
    """Create or change the limit of ``name``. Slots held and tokens left are kept; a new
    bucket starts full."""
    name, concurrency, rate, burst = validate_limit(name, concurrency, rate, burst)
    full = float(burst or max(1.0, rate or 1.0))
    doc: Doc = yield Call(
        "find_one_and_update",
        (
            {"_id": name},
            [
                {
                    "$set": {
                        "concurrency": concurrency,
                        "rate": rate,
                        "burst": None if rate is None else full,
                        "holders": {"$ifNull": ["$holders", []]},
                        "tokens": {"$min": [full, {"$ifNull": ["$tokens", full]}]},
                        "refilled_at": {"$ifNull": ["$refilled_at", now]},
                        "updated_at": now,
                    }
                }
            ],
        ),
        {"upsert": True, "return_document": ReturnDocument.AFTER},
        collection="limits",
    )
    return doc


def clear_limit(name: str) -> Op[bool]:
    result = yield Call("delete_one", ({"_id": name},), collection="limits")
    return bool(result.deleted_count)


def all_limits() -> Op[list[Doc]]:
    docs: list[Doc] = yield Call(
        "find",
        ({}, {**CONFIG_FIELDS, "holders": 1, "tokens": 1, "refilled_at": 1}),
        collection="limits",
    )
    return docs


def _live(now: dt.datetime) -> Doc:
    return {"$filter": {"input": "$holders", "as": "h", "cond": {"$gt": ["$$h.expires", now]}}}


def _tokens_now(now: dt.datetime) -> Doc:
    elapsed = {"$max": [0, {"$subtract": [now, "$refilled_at"]}]}
    return {"$min": ["$burst", {"$add": ["$tokens", {"$multiply": [elapsed, "$rate", 0.001]}]}]}


@dataclass(frozen=True)
class Acquired:
    """What ``acquire`` found: ``taken`` (a slot and/or token is this run's), ``limited``
    (False: the name has no limit now) and, when not taken, ``retry_at``: when one may be."""

    taken: bool
    limited: bool = True
    retry_at: dt.datetime | None = None


def acquire(
    name: str, run_id: str, key: str, worker_id: str, now: dt.datetime, lease_ms: int
) -> Op[Acquired]:
    """Take a slot and a token for one run of ``name`` in one atomic update: dead slots are
    dropped, the bucket is refilled, and the update matches only if a slot is free and a
    token is there."""
    live = _live(now)
    tokens = _tokens_now(now)
    holder = {
        "run_id": run_id,
        "key": key,
        "worker_id": worker_id,
        "expires": now + dt.timedelta(milliseconds=lease_ms),
    }
    has_room = {
        "$or": [
            {"$not": [{"$isNumber": "$concurrency"}]},
            {"$lt": [{"$size": live}, "$concurrency"]},
        ]
    }
    has_token = {"$or": [{"$not": [{"$isNumber": "$rate"}]}, {"$gte": [tokens, 1]}]}
    result = yield Call(
        "update_one",
        (
            {"_id": name, "holders": {"$type": "array"}, "$expr": {"$and": [has_room, has_token]}},
            [
                {
                    "$set": {
                        "holders": {
                            "$cond": [
                                {"$isNumber": "$concurrency"},
                                {"$concatArrays": [live, [{"$literal": holder}]]},
                                [],
                            ]
                        },
                        "tokens": {
                            "$cond": [{"$isNumber": "$rate"}, {"$subtract": [tokens, 1]}, None]
                        },
                        "refilled_at": now,
                    }
                }
            ],
        ),
        collection="limits",
    )
    if result.modified_count:
        return Acquired(taken=True)
    doc = yield Call("find_one", ({"_id": name},), collection="limits")
    if doc is None:
        return Acquired(taken=False, limited=False)
    return Acquired(taken=False, retry_at=retry_at(doc, now))


def retry_at(doc: Doc, now: dt.datetime) -> dt.datetime:
    """When a run of a blocked name may get a slot and a token at the earliest (a slot may
    free sooner, when a run ends: the worker hears of that from the change stream)."""
    waits = [0.0]
    rate, burst = doc.get("rate"), doc.get("burst")
    if isinstance(rate, int | float) and rate > 0:
        refilled = doc.get("refilled_at")
        tokens = doc.get("tokens")
        if isinstance(refilled, dt.datetime) and isinstance(tokens, int | float):
            have = refill(float(tokens), refilled, now, float(rate), float(burst or 1))
            waits.append(wait_for_token(have, float(rate)))
    concurrency = doc.get("concurrency")
    holders = [h for h in doc.get("holders") or () if isinstance(h, dict)]
    live = sorted(
        h["expires"]
        for h in holders
        if isinstance(h.get("expires"), dt.datetime) and h["expires"] > now
    )
    if isinstance(concurrency, int) and len(live) >= concurrency and live:
        waits.append((live[len(live) - concurrency] - now).total_seconds())
    return now + dt.timedelta(seconds=max(waits) + 0.001)


def extend(name: str, run_id: str, now: dt.datetime, lease_ms: int) -> Op[None]:
    """Keep a run's slot as long as its lease (called by the lease pinger with each ping)."""
    yield Call(
        "update_one",
        (
            {"_id": name, "holders.run_id": run_id},
            {"$set": {"holders.$.expires": now + dt.timedelta(milliseconds=lease_ms)}},
        ),
        collection="limits",
    )


def release(name: str, run_ids: Sequence[str]) -> Op[None]:
    """Give back the slots of runs that ended (or whose claim missed)."""
    yield Call(
        "update_one",
        ({"_id": name}, {"$pull": {"holders": {"run_id": {"$in": list(run_ids)}}}}),
        collection="limits",
    )
