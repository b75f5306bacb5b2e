"""The dashboard's flow page and a parent's children, as pure functions: the tree cut to a
bound (each node's children before the nodes below them, and how many were cut), a parent's
tasks in the order they were made (a spawn's by place: 10 after 9), the search below a parent
on its index, and a trigger's task saying who published it."""

from __future__ import annotations

import datetime as dt
from typing import Any

from pymongo import ASCENDING

from mtask.models import Task
from mtask.store import bulk, flows
from mtask.web.dashboard import _bounded, _breakable


def node(key: str, *children: dict[str, Any]) -> dict[str, Any]:
    return {"key": key, "children": list(children)}


def keys(tree: dict[str, Any]) -> list[str]:
    found, stack = [], [tree]
    while stack:
        n = stack.pop()
        found.append(n["key"])
        stack.extend(reversed(n["children"]))
    return found


def test_a_tree_within_the_bound_is_whole() -> None:
    tree = node("p", node("a", node("a1")), node("b"))
    assert _bounded(tree, 10) == (4, 4)
    assert keys(tree) == ["p", "a", "a1", "b"] and tree["more"] == 0


def test_a_tree_past_the_bound_keeps_each_nodes_children_first_and_says_how_many_were_cut() -> None:
    tree = node("p", node("a", node("a1"), node("a2")), node("b"), node("c", node("c1")))
    assert _bounded(tree, 4) == (4, 7)
    assert keys(tree) == ["p", "a", "b", "c"]  # the children before the grandchildren
    assert [tree["more"], tree["children"][0]["more"], tree["children"][2]["more"]] == [0, 2, 1]
    many = node("p", *(node(f"k{i}") for i in range(10)))
    assert _bounded(many, 3) == (3, 11) and many["more"] == 8


def test_a_spawns_children_stand_in_their_place_not_in_key_order() -> None:
    made = dt.datetime(2026, 1, 1)
    docs = [{"_id": f"p/spawn#1/{i}", "created_at": made, "spawn": {"index": i}} for i in (10, 9)]
    docs.append({"_id": "p/next", "created_at": made + dt.timedelta(seconds=1)})
    assert [d["_id"] for d in sorted(docs, key=flows.place)] == [
        "p/spawn#1/9",
        "p/spawn#1/10",
        "p/next",
    ]


def test_the_search_below_a_parent_reads_its_index_oldest_first() -> None:
    filt, sort = bulk.search_query(None, None, None, None, parent="p")
    assert filt == {"parent": "p"}
    assert sort == [("created_at", ASCENDING), ("_id", ASCENDING)]
    assert not bulk.search_across_names(None, "failed", None, None, "p")


def test_a_key_breaks_at_its_parts() -> None:
    assert str(_breakable("fulfil:o-1/spawn#1/<b>")) == (
        "fulfil:<wbr>o-1/<wbr>spawn#<wbr>1/<wbr>&lt;b&gt;"
    )


def test_a_triggers_task_says_who_published_it() -> None:
    now = dt.datetime(2026, 1, 1)
    doc = {
        "_id": "fulfil:o-1002",
        "name": "fulfil",
        "created_at": now,
        "triggered_by": {"trigger": "fulfil", "collection": "orders", "document": "o-1002"},
    }
    by = Task.from_document(doc).triggered_by
    assert by is not None
    assert by.said() == "published by trigger `fulfil` for `orders/o-1002`"
