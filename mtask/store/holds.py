"""A back-off's hold written: one update of a limit document, made if there is none, that only
ever moves a hold later (the rules are mtask.limits.holds)."""

from __future__ import annotations

import datetime as dt

from pymongo import ReturnDocument

from mtask.driver import Call, Doc, Op
from mtask.limits.rules import (
    GROUP_HOLDS,
    HELD_UNTIL,
    OVERRIDES_AT,
)


def hold(slot: str, group: str | None, until: dt.datetime, now: dt.datetime) -> Op[Doc]:
    """Hold ``slot``'s document (one group of it, if ``group``) until ``until``, in one update
    (made if there is none): the hold only ever moves later; a group's ended holds are dropped
    on the way."""
    sets: Doc = {"holders": {"$ifNull": ["$holders", []]}, OVERRIDES_AT: now, "updated_at": now}
    if group is None:
        sets[HELD_UNTIL] = {"$max": [{"$ifNull": [f"${HELD_UNTIL}", until]}, until]}
    else:
        holds = {"$ifNull": [f"${GROUP_HOLDS}", []]}
        same = {"$eq": ["$$h.group", {"$literal": group}]}
        kept = {"$filter": {"input": holds, "as": "h", "cond": {"$gt": ["$$h.until", now]}}}
        before = {"$filter": {"input": kept, "as": "h", "cond": same}}
        until_expr = {"$max": [until, {"$max": {"$map": {"input": before, "in": "$$this.until"}}}]}
        others = {"$filter": {"input": kept, "as": "h", "cond": {"$not": [same]}}}
        entry = {"group": {"$literal": group}, "until": until_expr}
        sets[GROUP_HOLDS] = {"$concatArrays": [others, [entry]]}
    if slot.startswith("\x00"):
        sets["resource"] = {"$literal": slot[1:]}
    doc: Doc = yield Call(
        "find_one_and_update",
        ({"_id": slot}, [{"$set": sets}]),
        {"upsert": True, "return_document": ReturnDocument.AFTER},
        collection="limits",
    )
    return doc
