"""Resetting a task's durable steps (``store.steps.reset``) without MongoDB: one fenced update
(its filter proves no run of the task is RUNNING), then the removed steps' spilled results go;
a reset that matched nothing says why. And ``signal_fate``: what becomes of a signal just sent
(the review's order-200: a wait already took a payload-less one)."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from scripted import ScriptedDriver, Step

from mtask.driver import Call
from mtask.errors import InvalidTask, InvalidTransition, TaskNotFound
from mtask.models import Task
from mtask.steps.signal_fate import NEXT_WAIT, fate
from mtask.store import steps

NOW = dt.datetime(2026, 11, 28, 3, 0, tzinfo=dt.UTC)
JOURNAL = [
    {"name": "charge", "kind": "call", "state": "done"},
    {"name": "label", "kind": "call", "state": "done", "spill": {"id": "s1", "chunks": 1}},
    {"name": "wait:approved", "kind": "signal", "state": "done", "signal": "approved", "nth": 0},
    {"name": "ship", "kind": "call", "state": "failed"},
]


def fenced(call: Call) -> None:
    filt, pipeline = call.args
    assert filt["_id"] == "k" and filt["steps.name"] == "label"
    assert filt["status"] == {"$in": ["pending", "failed", "cancelled"]}
    assert filt["runs"] == {"$not": {"$elemMatch": {"state": "RUNNING"}}}  # no run in flight
    assert pipeline[-1] == {
        "$set": {"steps": {"$slice": ["$steps", {"$indexOfArray": ["$steps.name", "label"]}]}}
    }
    assert "$$NOW" in str(pipeline[0]["$set"]["next_claim_at"])  # woken on the server's clock


def test_a_reset_is_one_fenced_update_then_the_spills_go() -> None:
    def spills(call: Call) -> None:
        assert call.args[0] == {"task": "k", "spill": {"$in": ["s1"]}}

    driver = ScriptedDriver(
        Step("find_one_and_update", reply={"status": "failed", "steps": JOURNAL}, check=fenced),
        Step("delete_many", collection="steps", check=spills),
    )
    done = driver.run(steps.reset("k", "label"))
    assert driver.done
    assert (done.index, done.removed, done.signals, done.woke) == (
        1,
        ["label", "wait:approved", "ship"],
        1,
        False,
    )


def test_a_pending_task_reset_runs_again_now() -> None:
    waiting = {"index": 2, "signal": "approved", "until": NOW}
    journal = [*JOURNAL[:2], {**JOURNAL[2], "state": "waiting"}]
    driver = ScriptedDriver(
        Step(
            "find_one_and_update",
            reply={"status": "pending", "steps": journal, "waiting": waiting},
        ),
        Step("delete_many", collection="steps"),
    )
    done = driver.run(steps.reset("k", "label"))
    assert done.woke and done.signals == 0


@pytest.mark.parametrize(
    ("found", "error", "words"),
    [
        (None, TaskNotFound, "no task with key 'k'"),
        ({"status": "pending", "steps": JOURNAL[:1]}, InvalidTask, "has no step 'label'"),
        (
            {"status": "running", "steps": JOURNAL, "runs": [{"state": "RUNNING"}]},
            InvalidTransition,
            "is running",
        ),
        (
            {"status": "cancelled", "steps": JOURNAL, "runs": [{"state": "RUNNING"}]},
            InvalidTransition,
            "is running",  # cancelled, its run not stopped yet
        ),
        ({"status": "succeeded", "steps": JOURNAL}, InvalidTransition, "is succeeded"),
    ],
)
def test_a_reset_that_matched_nothing_says_why(
    found: dict[str, Any] | None, error: type[Exception], words: str
) -> None:
    driver = ScriptedDriver(
        Step("find_one_and_update", reply=None),
        Step("find_one", reply=found),
    )
    with pytest.raises(error, match=words):
        driver.run(steps.reset("k", "label"))
    assert driver.done


def test_a_bad_step_name_is_refused_before_anything_is_sent() -> None:
    driver = ScriptedDriver()
    with pytest.raises(InvalidTask, match="step"):
        driver.run(steps.reset("k", ""))
    assert driver.calls == []


# -- what becomes of a signal ------------------------------------------------------------------


def task(steps_: list[dict[str, Any]], signals: list[str], status: str = "pending") -> Task:
    return Task.from_document(
        {
            "_id": "order-200",
            "status": status,
            "steps": [{"run_id": "r", "started_at": NOW, "attempts": 1, **s} for s in steps_],
            "signals": [{"name": n, "payload": None, "at": NOW} for n in signals],
        }
    )


def test_a_signal_after_a_wait_took_an_earlier_one_is_not_for_that_wait() -> None:
    took = {"name": "wait:approved", "kind": "signal", "state": "done", "signal": "approved"}
    said = fate(task([took | {"nth": 0}], ["approved", "approved"]), "approved", woke=False)
    assert said.startswith("kept, but only a further wait_for('approved') would take it")
    assert "mtask step reset order-200 wait:approved" in said


def test_what_other_signals_become() -> None:
    assert fate(task([], ["approved"]), "approved", woke=True) == "it woke the task"
    assert fate(task([], ["approved"]), "approved", woke=False) == NEXT_WAIT
    timed_out = {"name": "wait:x", "kind": "signal", "state": "timed_out", "signal": "x", "nth": 0}
    assert fate(task([timed_out], ["x"]), "x", woke=False).startswith(
        "no wait takes it: wait:x timed out"
    )
    second = {"name": "wait:x#2", "kind": "signal", "state": "waiting", "signal": "x", "nth": 1}
    first = timed_out | {"state": "done"}
    assert fate(task([first, second], ["x", "x"]), "x", woke=False) == "wait:x#2 takes it"
