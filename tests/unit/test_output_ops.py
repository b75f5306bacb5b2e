"""``store.output`` and the stream's catch-up without MongoDB: the exact calls, the fence in
every write's filter, and the numbering of a batch."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from pymongo.results import UpdateResult
from scripted import ScriptedDriver, Step

from mtask.driver import Call
from mtask.errors import TaskNotFound
from mtask.follow.streams import Follower, catch_up
from mtask.store import output

NOW = dt.datetime(2026, 3, 1, 12, 0, tzinfo=dt.UTC)


def fenced(call: Call) -> None:
    filt = call.args[0]
    assert filt["_id"] == "k" and filt["status"] == "running"
    assert filt["runs"] == {
        "$elemMatch": {"run_id": "r", "state": "RUNNING", "output_batch": {"$not": {"$gte": 3}}}
    }
    assert "$$NOW" in str(filt["$expr"])  # the lease, on the server's clock


def test_a_batch_is_numbered_by_the_fenced_update_then_inserted() -> None:
    def numbered(call: Call) -> None:
        docs = call.args[0]
        assert [(d["seq"], d["kind"], d["run_id"], d["attempt"]) for d in docs] == [
            (11, "log", "r", 2),
            (12, "chunk", "r", 2),
        ]
        assert all(d["task"] == "k" and d["expire_at"] == NOW for d in docs)

    def update(call: Call) -> None:
        fenced(call)
        change = call.args[1]
        assert change["$inc"] == {"output_seq": 2}
        assert change["$set"]["progress"]["run_id"] == "r"
        assert change["$set"]["runs.$.output"] == {"logs": 1, "chunks": 1}
        assert change["$set"]["runs.$.output_batch"] == 3

    driver = ScriptedDriver(
        Step("find_one_and_update", reply={"output_seq": 12}, check=update),
        Step("insert_many", collection="output", check=numbered),
    )
    entries = [{"kind": "log", "message": "m"}, {"kind": "chunk", "data": "d"}]
    written = driver.run(
        output.write(
            "k",
            "r",
            2,
            3,
            progress={"fraction": 0.5, "label": None},
            counts={"logs": 1, "chunks": 1},
            entries=entries,
            expire_at=NOW,
            now=NOW,
        )
    )
    assert written and driver.done


@pytest.mark.parametrize(
    ("recorded", "written"),
    [
        (None, False),  # the run lost its task: it inserts nothing
        ({"_id": "k"}, True),  # the run has recorded batch 3 (sent again after its commit)
    ],
)
def test_a_batch_the_fence_refuses_is_not_written_and_says_whether_it_was(
    recorded: dict[str, Any] | None, written: bool
) -> None:
    def asks_for_the_batch(call: Call) -> None:
        assert call.args[0]["runs"]["$elemMatch"]["output_batch"] == {"$gte": 3}

    driver = ScriptedDriver(
        Step("find_one_and_update", reply=None, check=fenced),
        Step("find_one", reply=recorded, check=asks_for_the_batch),
    )
    op = output.write(
        "k", "r", 1, 3, progress=None, counts=None, entries=[{"kind": "chunk", "data": 1}],
        expire_at=None, now=NOW,
    )  # fmt: skip
    assert driver.run(op) is written and driver.done


def test_seal_gives_the_entries_their_finished_tasks_expiry() -> None:
    expire = NOW + dt.timedelta(days=7)
    modified = UpdateResult({"n": 3, "nModified": 3, "ok": 1.0}, acknowledged=True)
    driver = ScriptedDriver(
        Step("find", reply=[{"_id": "a", "expire_at": expire}, {"_id": "b"}, {"_id": "c",
             "expire_held": True}]),
        Step("update_many", reply=modified, collection="output",
             check=lambda c: c.args == ({"task": "a"}, {"$set": {"expire_at": expire}})),
        Step("update_many", reply=modified, collection="output",
             check=lambda c: c.args == ({"task": "b"}, {"$unset": {"expire_at": ""}})),
    )  # fmt: skip
    assert driver.run(output.seal(["a", "b", "c"])) == 6 and driver.done


def test_keep_until_is_the_longest_retention_or_none_for_forever() -> None:
    assert output.keep_until({}, NOW) == NOW + dt.timedelta(days=30)
    assert output.keep_until({"keep_succeeded_ms": -1}, NOW) is None


def test_catch_up_reads_the_status_once_then_pages_after_last() -> None:
    at = Follower("tasks", after=5)
    page = [{"seq": 6, "kind": "chunk", "data": "x"}, {"seq": 7, "kind": "chunk", "data": "y"}]
    driver = ScriptedDriver(
        Step("find_one", reply={"_id": "k", "status": "running"}),
        Step("find", reply=page, collection="output",
             check=lambda c: c.args[0] == {"task": "k", "seq": {"$gt": 5}}),
        Step("find", reply=[], collection="output",
             check=lambda c: c.args[0] == {"task": "k", "seq": {"$gt": 7}}),
    )  # fmt: skip
    entries, over = driver.run(catch_up("k", at, None))
    assert [e.seq for e in entries] == [6, 7] and not over and at.last == 7
    assert not at.needs_read({"ns": {"coll": "tasks.output"}, "seq": 7})  # seen: skipped
    assert at.needs_read({"ns": {"coll": "tasks.output"}, "seq": 8})
    entries, over = driver.run(catch_up("k", at, None))
    assert entries == [] and not over and driver.done
    assert at.needs_read({"ns": {"coll": "tasks"}}) and at.check_task  # a status change


def test_catch_up_ends_once_the_task_is_finished_and_raises_for_no_task() -> None:
    at = Follower("tasks", after=0)
    driver = ScriptedDriver(
        Step("find_one", reply={"_id": "k", "status": "succeeded"}),
        Step("find", reply=[{"seq": 1, "kind": "log"}], collection="output"),
    )
    entries, over = driver.run(catch_up("k", at, ["log"]))
    assert [e.seq for e in entries] == [1] and over
    with pytest.raises(TaskNotFound):
        ScriptedDriver(Step("find_one", reply=None)).run(catch_up("x", Follower("tasks", 0), None))


@pytest.mark.parametrize(("stored", "moved"), [([{"seq": 7}], True), ([], False)])
def test_numbering_moves_past_entries_left_behind_only_for_the_owner(
    stored: list[dict[str, int]], moved: bool
) -> None:
    def update(call: Call) -> None:
        filt = call.args[0]
        assert filt["_id"] == "k" and filt["status"] == "running"
        assert filt["runs"] == {"$elemMatch": {"run_id": "r", "state": "RUNNING"}}
        assert "$$NOW" in str(filt["$expr"])  # the lease, on the server's clock
        assert call.args[1] == {"$max": {"output_seq": 7}}

    steps = [Step("find", collection="output", reply=stored)]
    if moved:
        steps.append(Step("update_one", reply=UpdateResult({"n": 1}, True), check=update))
    assert ScriptedDriver(*steps).run(output.skip_past_stored("k", "r")) is moved
