"""Issue 61's MongoDB operations read without I/O (``tests/unit/scripted.py``): a parallel
step's record by name, fenced; a child counted on its parent once (its bit set only if clear,
in the same update as the count), then the parents woken in one update on the server's clock;
the sweep's recount; the cancel that reaches the children; a deadline clamping a wait and a
retry; a journal's rename, drop and retry from a step, each one fenced update."""

from __future__ import annotations

import datetime as dt
from typing import Any

from bson.int64 import Int64
from pymongo.results import BulkWriteResult, UpdateResult
from scripted import ScriptedDriver, Step

from mtask.driver import Call
from mtask.steps import NEVER, Wait
from mtask.steps.children import BITS
from mtask.store import children, journal_edits
from mtask.store import steps as store_steps
from mtask.store.outcomes import Outcome, finish_update
from mtask.store.schema import OPEN_LIST
from mtask.vocabulary import RunState

NOW = dt.datetime(2026, 11, 28, 3, 0, tzinfo=dt.UTC)


def _updated(n: int) -> UpdateResult:
    return UpdateResult({"n": n, "nModified": n}, acknowledged=True)


def test_a_parallel_step_is_recorded_by_its_name_under_the_run_fence() -> None:
    entry = {"name": "b", "kind": "call", "state": "done", "group": "gather#1"}
    filt, update, options = store_steps.record_named_update("k", "r1", entry, None)
    assert filt["runs"] == {"$elemMatch": {"run_id": "r1", "state": "RUNNING"}}
    assert filt["steps.name"] == {"$ne": "b"} and update["$push"] == {"steps": entry}
    assert not options
    prior = {"name": "b", "attempts": 1, "state": "failed"}
    filt, update, options = store_steps.record_named_update("k", "r1", entry, prior)
    assert filt["steps"] == {"$elemMatch": {"name": "b", "attempts": 1, "state": "failed"}}
    assert update["$set"] == {"steps.$[s]": entry} and options["array_filters"] == [{"s.name": "b"}]


def test_a_child_is_counted_once_and_its_parent_woken_on_the_server_clock() -> None:
    request = children.count_request({"parent": "p", "step": "spawn#1", "index": 37}, False)
    assert request is not None
    word, bit = divmod(37, BITS)
    field = f"spawned.bits.{word}"
    assert request._filter == {
        "_id": "p",
        "spawned.step": "spawn#1",
        field: {"$bitsAllClear": [bit]},
    }
    assert request._doc == {
        "$bit": {field: {"or": Int64(1 << bit)}},
        "$inc": {"spawned.done": 1, "spawned.failed": 1},
    }
    for odd in (None, "p", {"parent": "p", "step": "s", "index": -1}, {"parent": 1, "step": "s"}):
        assert children.count_request(odd, True) is None  # any shape: never stops the writer

    def wakes(call: Call) -> None:
        filt, pipeline = call.args
        assert filt["_id"] == {"$in": ["p"]} and filt["status"] == "pending"
        assert pipeline[0]["$set"]["next_claim_at"] == "$$NOW"

    driver = ScriptedDriver(
        Step(
            "find",
            reply=[
                {
                    "_id": "p/s/0",
                    "status": "succeeded",
                    "spawn": {"parent": "p", "step": "s", "index": 0},
                },
                {"_id": "odd", "status": "failed", "spawn": "hand-written"},
            ],
        ),
        Step("bulk_write", reply=BulkWriteResult({}, acknowledged=True)),
        Step("update_many", reply=_updated(1), check=wakes),
    )
    assert driver.run(children.count_finished(["p/s/0", "odd", "p/s/1"])) == 1
    assert driver.done
    assert len(driver.calls[1].args[0]) == 1  # the odd one is not counted


def test_the_sweep_recounts_a_stale_parent_and_wakes_it_or_notes_the_count() -> None:
    parent = {"_id": "p", "waiting": {"children": "s"}, "spawned": {"step": "s", "total": 3}}
    driver = ScriptedDriver(
        Step("find", reply=[parent, {**parent, "_id": "q"}]),
        Step("count_documents", reply=3),
        Step("update_one", reply=_updated(1)),  # p: all finished, woken
        Step("count_documents", reply=1),
        Step("update_one", reply=_updated(1)),  # q: counted, not woken
    )
    assert driver.run(children.sweep(NOW, NOW)) == 1
    assert driver.done
    assert driver.calls[0].kwargs["hint"] == children.WAITING_INDEX
    assert driver.calls[4].args[1] == {"$currentDate": {"spawned.checked_at": True}}


def test_cancelling_a_parent_cancels_its_open_children_level_by_level() -> None:
    """Each level: one update of the open children of up to ``PAGE`` parents (no count
    bound), then one read of those that spawned in turn."""
    driver = ScriptedDriver(
        Step("update_many", reply=_updated(1)),
        Step("find", reply=[{"_id": "c1"}]),  # c1 spawned: its children next
        Step("update_many", reply=_updated(1)),
        Step("find", reply=[]),
    )
    assert driver.run(children.cancel_children("p", NOW)) == 2
    assert driver.done
    first = driver.calls[0].args[0]
    assert first["parent"] == {"$in": ["p"]} and first["status"] == {"$in": OPEN_LIST}
    assert "limit" not in driver.calls[0].kwargs and "limit" not in driver.calls[1].kwargs
    assert driver.calls[1].args[0]["spawned"] == {"$exists": True}
    assert driver.calls[2].args[0]["parent"] == {"$in": ["c1"]}


def test_a_wait_for_children_wakes_at_once_if_they_finished_and_a_deadline_clamps_it() -> None:
    wait = Wait(3, None, NEVER, children="spawn#1")
    _, pipeline = finish_update(Outcome("k", "r", RunState.WAITING, wait=wait), NOW)
    sets = pipeline[0]["$set"]
    assert sets["waiting"]["$literal"] == {
        "until": NEVER,
        "index": 3,
        "step": "spawn#1",
        "children": "spawn#1",
    }
    assert sets["available_at"]["$cond"][0] == {"$gte": ["$spawned.done", "$spawned.total"]}
    clamp = pipeline[1]["$set"]["available_at"]["$min"]
    assert clamp[0] == "$available_at" and "$options.deadline" in str(clamp[1])
    _, failed = finish_update(Outcome("k", "r", RunState.FAIL, error="x"), NOW)
    assert "$options.deadline" in str(failed[2]) and "$options.deadline" not in str(failed[1])
    _, success = finish_update(Outcome("k", "r", RunState.SUCCESS), NOW)
    assert "deadline" not in str(success)


def _fenced(step: str) -> Any:
    def check(call: Call) -> None:
        filt = call.args[0]
        assert filt["steps.name"] == step and filt["status"]["$in"][0] == "pending"
        assert filt["runs"] == {"$not": {"$elemMatch": {"state": "RUNNING"}}}

    return check


def test_a_rename_and_a_drop_are_one_fenced_update_each() -> None:
    before = {
        "status": "pending",
        "steps": [{"name": "a"}, {"name": "b", "spill": {"id": "s"}}],
        "waiting": {"index": 1},
    }
    driver = ScriptedDriver(
        Step("find_one_and_update", reply=before, check=_fenced("b")),
        Step("delete_many", collection="steps"),
    )
    done = driver.run(journal_edits.remark("k", "b"))
    assert driver.done and (done.index, done.to, done.woke) == (1, None, True)
    driver = ScriptedDriver(Step("find_one_and_update", reply=before, check=_fenced("a")))
    done = driver.run(journal_edits.remark("k", "a", "a2"))
    assert driver.done and (done.index, done.to, done.woke) == (0, "a2", False)
    filt = driver.calls[0].args[0]
    assert {"steps.name": {"$ne": "a2"}} in filt["$and"]
    pipeline = driver.calls[0].args[1]
    assert {"$literal": "a2"} in pipeline[0]["$set"]["steps"]["$map"]["in"]["$cond"][1][
        "$mergeObjects"
    ][1].values()


def test_a_retry_from_a_step_resets_and_reopens_in_one_update() -> None:
    def check(call: Call) -> None:
        filt, pipeline = call.args
        assert filt["status"] == {"$in": ["failed", "cancelled"]} and filt["steps.name"] == "b"
        assert "$slice" in str(pipeline) and '"pending"' in str(pipeline).replace("'", '"')

    driver = ScriptedDriver(
        Step(
            "find_one_and_update",
            reply={"status": "failed", "steps": [{"name": "a"}, {"name": "b"}]},
            check=check,
        ),
        Step("find_one", reply={"_id": "k", "status": "pending"}),
    )
    assert driver.run(journal_edits.retry_from("k", "b", NOW))["status"] == "pending"
    assert driver.done
