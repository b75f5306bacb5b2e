"""store.across without MongoDB: the parts of a query across names, and MongoDB's order."""

from __future__ import annotations

import datetime as dt
from typing import Any

from bson.max_key import MaxKey
from bson.min_key import MinKey
from bson.objectid import ObjectId
from pymongo import ASCENDING, DESCENDING

from mtask.driver import GATHER
from mtask.store import across


def test_string_names_go_200_to_a_part_and_the_others_last() -> None:
    names: list[Any] = [f"n{i:03d}" for i in range(450)] + ["", None, 7, {"$x": 1}, ["a"]]
    parts = across.name_parts(names)
    assert [len(p["$in"]) for p in parts[:-1]] == [200, 200, 50]
    assert parts[-1] is across.NOT_A_NAME  # "", none, and every name that is not a string
    assert sorted(n for p in parts[:-1] for n in p["$in"]) == sorted(names[:450])
    assert across.name_parts([]) == [across.NOT_A_NAME]


def test_the_order_key_follows_mongodbs_type_order() -> None:
    at = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    ordered = [MinKey(), None, -1, 2.5, 3, "", "a", {"a": 1}, [1], b"x", ObjectId(), False, at]
    ordered.append(MaxKey())
    keys = [across.order_key(v) for v in ordered]
    assert keys == sorted(keys)
    assert across.order_key(True) > across.order_key(False) > across.order_key(10**9)


def test_a_sorted_page_merges_the_parts_pages() -> None:
    """One find per part, sent together; their pages merged in the sort's order, cut."""
    at = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    sort = [("created_at", DESCENDING), ("_id", DESCENDING)]
    op = across.find_sorted({"status": "failed"}, sort, 3, ["b", "a", 7])
    call = next(op)
    assert call.method == GATHER and len(call.args) == 2
    assert [c.args[0]["$and"][1]["name"] for c in call.args] == [
        {"$in": ["a", "b"]},
        across.NOT_A_NAME,
    ]
    assert all(c.kwargs == {"sort": sort, "limit": 3} for c in call.args)
    first = [{"_id": "k1", "created_at": at}, {"_id": "k0", "created_at": at}]
    other = [{"_id": "k2", "created_at": at}, {"_id": "z", "created_at": None}]
    try:
        op.send([first, other])
    except StopIteration as stop:
        assert [d["_id"] for d in stop.value] == ["k2", "k1", "k0"]
    else:
        raise AssertionError("find_sorted asked for more")
    ascending = [("next_claim_at", ASCENDING), ("_id", ASCENDING)]
    op = across.find_sorted({}, ascending, 2, [])
    next(op)
    try:
        op.send([[{"_id": "b", "next_claim_at": at}, {"_id": "a", "next_claim_at": at}]])
    except StopIteration as stop:
        assert [d["_id"] for d in stop.value] == ["a", "b"]
