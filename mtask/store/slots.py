"""A limit's slots taken, extended, joined and given back: each one atomic update of a limit
document whose filter decides on the server's clock (the filters and pipelines are
mtask.limits.slots')."""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, MutableSet, Sequence
from typing import Any

from pymongo import UpdateMany, UpdateOne
from pymongo.errors import BulkWriteError

from mtask.driver import DUPLICATE_KEY, Call, Doc, Op
from mtask.limits import measured
from mtask.limits.rules import (
    BUCKET_CLOCK_SLACK,
    GROUP_HOLDS,
    GROUP_SEPARATOR,
    HELD_UNTIL,
    is_group_slot,
    is_resource,
    resource_of,
    runs_at_once,
)
from mtask.limits.slots import GRANTED_KEPT, TAKEN_AT, Request, Taken, decide, expire_at, is_lock
from mtask.store.open_groups import lock_runs
from mtask.store.schema import literal


def _bucket(now: dt.datetime) -> tuple[Doc, Doc]:
    """The bucket's clock (``refilled_at``, ``now`` if it has none) and whether it is more than
    ``BUCKET_CLOCK_SLACK`` ahead of ``now`` (set before the server's clock was stepped back:
    ``limits.refill``, ``limits.bucket_clock``), as expressions over the document."""
    refilled = {"$cond": [{"$eq": [{"$type": "$refilled_at"}, "date"]}, "$refilled_at", now]}
    return refilled, {"$gt": [refilled, now + BUCKET_CLOCK_SLACK]}


def _terms(request: Request, now: dt.datetime) -> tuple[Any, Any, Any, Doc, Doc]:
    """The slot's limit (its document's fields for a name, literals for a group), its live
    holders and its tokens now, as expressions over the document."""
    limit = request.limit
    conc: Any = "$concurrency" if limit is None else limit.concurrency
    rate: Any = _number("$rate") if limit is None else limit.rate
    burst: Any = _burst(rate) if limit is None else (None if limit.rate is None else limit.full())
    cond: Doc = {"$gt": ["$$h.expires", now]}
    if request.replaces is not None:  # the ended run handing its place over is not counted
        cond = {"$and": [cond, {"$ne": ["$$h.run_id", literal(request.replaces)]}]}
    live: Doc = {"$filter": {"input": HOLDERS, "as": "h", "cond": cond}}
    refilled, stepped_back = _bucket(now)
    elapsed = {"$max": [0, {"$subtract": [now, refilled]}]}
    tokens: Doc = {
        "$cond": [
            stepped_back,  # limits.refill: full again
            burst,
            {
                "$min": [
                    burst,
                    {
                        "$add": [
                            {"$ifNull": [_number("$tokens"), burst]},
                            {"$multiply": [elapsed, rate, 0.001]},
                        ]
                    },
                ]
            },
        ]
    }
    return conc, rate, burst, live, tokens


HOLDERS: Doc = {"$cond": [{"$isArray": "$holders"}, "$holders", []]}
"""A slot's holders, as a take reads them: none where its document has no array of them (a
limit written by hand holds its limit's fields alone)."""


def _number(field: str) -> Doc:
    """A field's value if it is a number, else null (as ``limits.rules`` reads it)."""
    return {"$cond": [{"$isNumber": field}, field, None]}


def _burst(rate: Doc) -> Doc:
    """A name's bucket size: its ``burst`` if a number, else as large as its rate and at least
    one token (``Limit.full``: what ``set_limit`` writes; a limit written by hand may say a
    rate alone)."""
    return {"$ifNull": [_number("$burst"), {"$max": [1, rate]}]}


def _new_group(slot: str, now: dt.datetime) -> Doc:
    name, _, group = slot.partition(GROUP_SEPARATOR)
    return {"name": name, "group": group, "holders": [], "expire_at": expire_at(now)}


def _filter(request: Request, now: dt.datetime) -> Doc:
    """The slot's document, only if a slot is free and a token there: a full slot is not
    written at all (no change event wakes the keys that wait for it)."""
    conc, rate, _, live, tokens = _terms(request, now)
    units = request.units
    if units == 1 and not is_resource(request.slot):
        room: Doc = {"$lt": [{"$size": live}, conc]}  # a name's or group's: one unit each
    else:  # a resource's holders may be runs of several names, each of its own units
        room = {"$lte": [{"$add": [_units(live), units]}, conc]}
    ok = {
        "$and": [
            {"$or": [{"$not": [{"$isNumber": conc}]}, room]},
            {"$or": [{"$not": [{"$isNumber": rate}]}, {"$gte": [tokens, units]}]},
            *_not_held(request, now),
            *([measured.room()] if is_resource(request.slot) else []),
        ]
    }
    # a name's document must exist: a cleared limit is not made again (one written by hand
    # with no holders is taken as one with none: ``HOLDERS``)
    return {"_id": request.slot, **_group_not_held(request, now), "$expr": ok}


def _units(live: Doc) -> Doc:
    """The units the live holders take (a holder without ``units`` takes one)."""
    return {"$sum": {"$map": {"input": live, "as": "u", "in": {"$ifNull": ["$$u.units", 1]}}}}


def _not_held(request: Request, now: dt.datetime) -> list[Doc]:
    """What a back-off adds to a name's (or a resource's) take: its hold has ended
    (``mtask.limits.holds``); a missing hold is none (null sorts before every date)."""
    if request.limit is not None:
        return []  # a group's slot: its holds are its name's
    return [{"$not": [{"$gt": [f"${HELD_UNTIL}", now]}]}]


def _group_not_held(request: Request, now: dt.datetime) -> Doc:
    """What a group's back-off adds to the take of its name's slot: no hold of the run's group
    that ends after ``now``, as a query of the array (a missing or malformed ``group_holds``
    holds nothing); a query costs the take less than the same test as an expression."""
    if request.limit is not None or request.group is None:
        return {}
    hold = {"group": request.group, "until": {"$gt": now}}
    return {GROUP_HOLDS: {"$not": {"$elemMatch": hold}}}


def _holder(request: Request, worker_id: str, now: dt.datetime) -> Doc:
    holder: Doc = {
        "run_id": request.run_id,
        "key": request.key,
        "worker_id": worker_id,
        "expires": now + dt.timedelta(milliseconds=request.lease_ms),
    }
    if request.units != 1:
        holder["units"] = request.units
    return holder


def _lock(request: Request, worker_id: str, now: dt.datetime) -> UpdateOne:
    """Take a lock's slot, or fail on ``_id`` if it is full (see the module's docstring). The
    holders stay sorted by lease end and at most ``n``: room is fewer than ``n`` holders, or
    ``n`` with an ended lease, which the push drops (it sorts first, ahead of the new one)."""
    assert request.limit is not None and request.limit.concurrency is not None
    n = request.limit.concurrency
    if request.replaces is not None:
        # the ended run's place goes to this one, if it still holds it and the slot holds no
        # more runs than it allows (else, as a missed upsert, an error: the exact path decides)
        return UpdateOne(
            {
                "_id": request.slot,
                "holders.run_id": request.replaces,
                f"holders.{n}": {"$exists": False},
            },
            {
                "$set": {
                    "holders.$": _holder(request, worker_id, now),
                    TAKEN_AT: now,
                    "expire_at": expire_at(now),
                }
            },
            upsert=True,
        )
    name, _, group = request.slot.partition(GROUP_SEPARATOR)
    room = [
        {f"holders.{n - 1}": {"$exists": False}},
        {f"holders.{n}": {"$exists": False}, "holders": {"$elemMatch": {"expires": {"$lte": now}}}},
    ]
    update = {
        "$push": {
            "holders": {
                "$each": [_holder(request, worker_id, now)],
                "$sort": {"expires": 1},
                "$slice": -n,
            }
        },
        "$set": {
            TAKEN_AT: now,
            "concurrency": n,
            "rate": None,
            "burst": None,
            "expire_at": expire_at(now),
        },
        "$setOnInsert": {"name": name, "group": group},
    }
    return UpdateOne({"_id": request.slot, "$or": room}, update, upsert=True)


def _take_pipeline(request: Request, worker_id: str, now: dt.datetime) -> list[Doc]:
    """Add the run as a holder and take a token (the filter made sure there is room)."""
    conc, rate, burst, live, tokens = _terms(request, now)
    holder = _holder(request, worker_id, now)
    granted = {"$cond": [{"$isArray": "$granted"}, "$granted", []]}
    refilled, stepped_back = _bucket(now)
    sets: Doc = {
        "holders": {
            "$cond": [{"$isNumber": conc}, {"$concatArrays": [live, [literal(holder)]]}, []]
        },
        "tokens": {"$cond": [{"$isNumber": rate}, {"$subtract": [tokens, request.units]}, None]},
        # limits.bucket_clock: a take whose time is behind the bucket's clock (another
        # worker's estimate of the server's clock, some milliseconds behind) added no tokens
        # and leaves it, else the next take would count that stretch again
        "refilled_at": {"$cond": [stepped_back, now, {"$max": [now, refilled]}]},
        "granted": {
            "$cond": [
                {"$isNumber": conc},
                [],
                {
                    "$slice": [
                        {"$concatArrays": [granted, [literal(request.run_id)]]},
                        -GRANTED_KEPT,
                    ]
                },
            ]
        },
        TAKEN_AT: now,
    }
    if request.limit is not None:  # a group's document carries its group's limit
        sets |= {
            "concurrency": conc,
            "rate": rate,
            "burst": burst,
            "expire_at": expire_at(now),
        }
    return [{"$set": sets}]


def take(
    requests: Sequence[Request],
    worker_id: str,
    now: dt.datetime,
    known: MutableSet[str] | None = None,
    count_in: Sequence[str] = (),
) -> Op[list[Taken]]:
    """Take each requested slot if it is free (and a token there): the locks in one bulk
    write, the others (and the locks refused with a lease that had ended) in one more and a
    read. Returns what became of each request, in order. ``known``: the groups' documents
    this worker has seen exist (not made again by the exact path; kept up to date).
    ``count_in``: groups' slots whose sequences' running tasks are counted in first
    (``count_lock_runs``: their names' groups were sequences until a moment ago)."""
    known = set() if known is None else known
    if count_in:
        yield from count_lock_runs(count_in, now, known)
    out: list[Taken | None] = [None] * len(requests)
    locks = [i for i, r in enumerate(requests) if is_lock(r)]
    if locks:
        refused = yield from _take_locks([requests[i] for i in locks], worker_id, now, known)
        for j, i in enumerate(locks):
            if j not in refused:
                out[i] = Taken(taken=True, holder=True)
    rest = [i for i, t in enumerate(out) if t is None]
    if rest:
        got = yield from _take_exact([requests[i] for i in rest], worker_id, now, known)
        for i, t in zip(rest, got, strict=True):
            out[i] = t
    return [t for t in out if t is not None]


def _take_locks(
    requests: Sequence[Request], worker_id: str, now: dt.datetime, known: MutableSet[str]
) -> Op[set[int]]:
    """Take the locks' slots in one unordered bulk write; returns the positions refused (a
    full slot's upsert fails on ``_id``; any other write error refuses its request too)."""
    ops = [_lock(r, worker_id, now) for r in requests]
    refused: dict[int, int] = {}
    try:
        yield Call("bulk_write", (ops,), {"ordered": False}, collection="limits")
    except BulkWriteError as exc:
        details = exc.details or {}
        if details.get("writeConcernErrors"):
            raise
        refused = {int(e["index"]): int(e.get("code", 0)) for e in details.get("writeErrors", ())}
    for j, request in enumerate(requests):
        if refused.get(j, DUPLICATE_KEY) == DUPLICATE_KEY:  # taken, or full: it exists
            known.add(request.slot)
    return set(refused)


def _take_exact(
    requests: Sequence[Request], worker_id: str, now: dt.datetime, known: MutableSet[str]
) -> Op[list[Taken]]:
    """The exact path: each request a pipeline update (a group's document made first if this
    worker has not seen it), in one ordered bulk write, then one read."""
    made = sorted({r.slot for r in requests if r.limit is not None and r.slot not in known})
    ops = [
        # a group's document is made if it is not there (an update of one that is changes
        # nothing: no write, no event); then each request in turn, in order
        UpdateOne({"_id": slot}, {"$setOnInsert": _new_group(slot, now)}, upsert=True)
        for slot in made
    ]
    ops += [UpdateOne(_filter(r, now), _take_pipeline(r, worker_id, now)) for r in requests]
    yield Call("bulk_write", (ops,), {"ordered": True}, collection="limits")
    slots = sorted({r.slot for r in requests})
    docs: list[Doc] = yield Call(
        "find",
        (
            {"_id": {"$in": slots}},
            {
                "granted": 1,
                "holders": 1,
                "concurrency": 1,
                "rate": 1,
                "burst": 1,
                "tokens": 1,
                "refilled_at": 1,
                HELD_UNTIL: 1,
                GROUP_HOLDS: 1,
                **dict.fromkeys(measured.FIELDS, 1),
            },
        ),
        collection="limits",
    )
    found = {d["_id"]: d for d in docs}
    for request in requests:  # a group's document removed by its TTL is made again next time
        if request.limit is not None:
            if request.slot in found:
                known.add(request.slot)
            else:
                known.discard(request.slot)
    return decide(requests, found, now)


def extend(
    request: Request, worker_id: str, now: dt.datetime, joins: bool = False
) -> Op[bool | None]:
    """Keep a run's place in its slot as long as its lease (``request.lease_ms`` from ``now``;
    called by the lease pinger with each ping); a group's document is kept for ``GROUP_TTL``
    more. ``joins``: the run holds no place there (its take only granted it a token, or its
    slot stopped limiting runs at once): it takes one if the slot limits runs at once now.

    Returns ``True`` if the run holds its place (kept, or taken now), ``None`` if the slot
    limits no runs at once (its document is gone: its limit cleared; or it limits only a rate)
    and so holds none, and ``False`` if the run held a place there and lost it: its lease ran
    out (the worker was frozen, or cut off from MongoDB, past it) and another run took its
    place, while nobody took the task. It must stop, or the slot's runs would be one more than
    its limit.

    A run that joins is never refused, even by a slot that is full: a concurrency added to a
    limit of a rate alone (or lowered) applies to the runs that start from then on, and runs in
    flight are not stopped by a change of limit; they count towards it (new runs wait until
    fewer than the limit run), as the places kept by a limit lowered do (``set_limit``)."""
    group: Doc = {"expire_at": expire_at(now)} if is_group_slot(request.slot) else {}
    if joins:
        # one update: the run's place kept if it has one, else taken if the slot (still there)
        # limits runs at once; a slot limiting only a rate, or gone, matches nothing
        others = {"$ne": ["$$h.run_id", literal(request.run_id)]}
        result = yield Call(
            "update_one",
            (
                {
                    "_id": request.slot,
                    "holders": {"$type": "array"},
                    "$or": [
                        {"holders.run_id": request.run_id},
                        {"$expr": {"$isNumber": "$concurrency"}},
                    ],
                },
                [
                    {
                        "$set": {
                            "holders": {
                                "$concatArrays": [
                                    {"$filter": {"input": "$holders", "as": "h", "cond": others}},
                                    [literal(_holder(request, worker_id, now))],
                                ]
                            },
                            **group,
                        }
                    }
                ],
            ),
            collection="limits",
        )
        return True if result.matched_count else None
    result = yield Call(
        "update_one",
        (
            {"_id": request.slot, "holders.run_id": request.run_id},
            {"$set": {"holders.$.expires": _holder(request, worker_id, now)["expires"]} | group},
        ),
        collection="limits",
    )
    if result.matched_count:
        return True
    there = yield Call("find_one", ({"_id": request.slot}, {"concurrency": 1}), collection="limits")
    if there is None or runs_at_once(there.get("concurrency")) is None:
        return None
    return False


def join(
    requests: Sequence[Request], worker_id: str, now: dt.datetime, known: MutableSet[str]
) -> Op[None]:
    """Give each run of ``requests`` a place among its slot's holders if it holds none, however
    full the slot is (``extend``'s ``joins``, at once): runs in flight count towards a changed
    limit and are not stopped by it. One ordered bulk write: a group's document made first if
    this worker has not seen it (``known``), then one update per request that matches only
    if the run is not a holder yet (a name's document must exist: a cleared limit is not made
    again). The holders stay sorted by lease end, as a lock's take keeps them."""
    made = sorted({r.slot for r in requests if is_group_slot(r.slot) and r.slot not in known})
    ops: list[UpdateOne | UpdateMany] = [
        UpdateOne({"_id": slot}, {"$setOnInsert": _new_group(slot, now)}, upsert=True)
        for slot in made
    ]
    if requests:  # a limit written by hand with no array of holders: one, empty, to join
        slots = sorted({r.slot for r in requests})
        bare = {"_id": {"$in": slots}, "holders": {"$not": {"$type": "array"}}}
        ops.append(UpdateMany(bare, {"$set": {"holders": []}}))
    ops += [
        UpdateOne(
            {"_id": r.slot, "holders": {"$type": "array"}, "holders.run_id": {"$ne": r.run_id}},
            {
                "$push": {
                    "holders": {"$each": [_holder(r, worker_id, now)], "$sort": {"expires": 1}}
                },
                "$set": {TAKEN_AT: now},
            },
        )
        for r in requests
    ]
    if ops:
        yield Call("bulk_write", (ops,), {"ordered": True}, collection="limits")
    for slot in made:
        known.add(slot)


COUNTED_FOR = dt.timedelta(seconds=5)
"""How long a place ``count_lock_runs`` gives a sequence's running task lasts at most (its
lease's end, if sooner): every take before ``limits.SETTLE_AFTER`` counts the running tasks in
again first, and its own worker's ping keeps the place once that worker counted it in
(``join``, ``extend``); a run that ended before then holds it no longer than this."""


def count_lock_runs(slots: Sequence[str], now: dt.datetime, known: MutableSet[str]) -> Op[int]:
    """Give each live run of a task that holds the lock of the group of one of ``slots`` (a
    group's slot documents of names whose groups were sequences until a moment ago:
    ``limits.LOCK_RUNS``) a place among that slot's holders, if it holds no live one, however
    full the slot is, as its own worker does once it hears of the change (``join``): a take
    that follows counts it. One read (``open_groups.lock_runs``), then one ordered bulk write:
    a group's document made first if this worker has not seen it (``known``), then one update
    per run whose filter matches only if the run holds no place whose lease has not ended at
    ``now`` (a place its worker keeps is never shortened). The place ends with the run's lease,
    ``COUNTED_FOR`` from ``now`` at the latest. Returns how many runs it counted in."""
    by_pair = {_pair(slot): slot for slot in slots if is_group_slot(slot)}
    if not by_pair:
        return 0
    docs: list[Doc] = yield lock_runs(sorted(by_pair))
    ops: list[UpdateOne] = []
    counted: set[str] = set()
    for doc in docs:
        options = doc.get("options")
        group = options.get("group") if isinstance(options, dict) else None
        slot = by_pair.get((str(doc.get("name")), str(group)))
        for run in doc.get("runs") or ():
            if slot is None or not isinstance(run.get("lease_expires_at"), dt.datetime):
                continue
            expires = min(run["lease_expires_at"], now + COUNTED_FOR)
            ops.append(_count_in(slot, doc["_id"], run, expires, now))
            counted.add(slot)
    if not ops:
        return 0
    made = sorted(counted - set(known))
    upserts = [
        UpdateOne({"_id": slot}, {"$setOnInsert": _new_group(slot, now)}, upsert=True)
        for slot in made
    ]
    yield Call("bulk_write", ([*upserts, *ops],), {"ordered": True}, collection="limits")
    for slot in made:
        known.add(slot)
    return len(ops)


def _pair(slot: str) -> tuple[str, str]:
    name, _, group = slot.partition(GROUP_SEPARATOR)
    return name, group


def _count_in(slot: str, key: str, run: Doc, expires: dt.datetime, now: dt.datetime) -> UpdateOne:
    """``run`` (of the task ``key``) holds a place in ``slot`` until ``expires``, unless it
    holds a live one: any place of it that ended is replaced."""
    run_id = run.get("run_id")
    holder = {"run_id": run_id, "key": key, "worker_id": run.get("worker_id"), "expires": expires}
    others = {"$ne": ["$$h.run_id", literal(run_id)]}
    return UpdateOne(
        {
            "_id": slot,
            "holders": {"$not": {"$elemMatch": {"run_id": run_id, "expires": {"$gt": now}}}},
        },
        [
            {
                "$set": {
                    "holders": {
                        "$concatArrays": [
                            {"$filter": {"input": HOLDERS, "as": "h", "cond": others}},
                            [literal(holder)],
                        ]
                    },
                    TAKEN_AT: now,
                }
            }
        ],
    )


def charge_measured(slots: Sequence[str], tokens: int) -> Op[None]:
    """Charge ``tokens`` to the current window of each shared resource of ``slots`` that has a
    limit in tokens (``mtask.limits.measured``): one update, on the server's clock."""
    if not slots or tokens <= 0:
        return
    yield Call(
        "update_many",
        (
            {
                "_id": {"$in": sorted(slots)},
                measured.LIMIT: {"$type": "number"},
                measured.WINDOW: {"$type": "number"},
            },
            measured.charged(tokens, TAKEN_AT),
        ),
        collection="limits",
    )


def admit_measured(slots: Sequence[str], now: dt.datetime) -> Op[tuple[float, str] | None]:
    """Admit a step of a run that takes the shared resources ``slots`` (docs/flow-control.md
    #limits-in-tokens): for each one with a limit in tokens, one update whose filter is its
    window's room (``measured.room``, on ``$$NOW``) and that makes its current window the
    stored one. ``None``: admitted by all; else the seconds until the first that refused has
    room again (its window's end, from the document as read then and ``now``, the server's
    time as the worker estimates it: at least a millisecond, the server decides again) and
    what to say of it (the resource, its window's charge). A resource whose limit in tokens
    was removed admits."""
    for slot in sorted(slots):
        limited = {
            "_id": slot,
            measured.LIMIT: {"$type": "number"},
            measured.WINDOW: {"$type": "number"},
        }
        result = yield Call(
            "update_one",
            ({**limited, "$expr": measured.room()}, measured.admitted(TAKEN_AT)),
            collection="limits",
        )
        if result.matched_count:
            continue
        doc: Doc | None = yield Call(
            "find_one", (limited, dict.fromkeys(measured.FIELDS, 1)), collection="limits"
        )
        if doc is None:
            continue
        window = measured.current(doc, now)
        said = "" if window is None else f": {window.describe()}"
        wait = max(measured.window_wait(doc, now) or 0.0, 0.001)
        return wait, f"resource `{resource_of(slot)}`{said}"
    return None


def release(by_slot: Mapping[str, Sequence[str]]) -> Op[None]:
    """Give back the slots of runs that ended (or whose claim missed): one write for all."""
    if not by_slot:
        return
    run_ids = sorted({r for ids in by_slot.values() for r in ids})
    yield Call(
        "update_many",
        (
            # a document with no array of holders (written by hand) holds no run to give back
            {"_id": {"$in": sorted(by_slot)}, "holders": {"$type": "array"}},
            {"$pull": {"holders": {"run_id": {"$in": run_ids}}}},
        ),
        collection="limits",
    )
