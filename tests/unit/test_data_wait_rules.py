"""Waits on data without MongoDB: ``ctx.wait_until`` in the durable-steps engine
(``mtask.steps.RunSteps`` on ``MemorySteps``), the predicate's rules, and the store's writes
read without I/O (``store.datawaits``, the WAITING outcome of a data wait). What MongoDB decides
(the find, the wake-up, the index) is tests/integration/test_data_waits.py's."""

from __future__ import annotations

import asyncio
import datetime as dt
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from scripted import ScriptedDriver, Step

from mtask.models import Step as StepModel
from mtask.models import Waiting
from mtask.steps import (
    NEVER,
    ConditionTimeout,
    MemorySteps,
    RunSteps,
    SignalTimeout,
    StepError,
    StepMismatch,
    Suspended,
    wait_ids,
)
from mtask.store import datawaits
from mtask.store.outcomes import Outcome, finish_update
from mtask.vocabulary import RunState

T0 = dt.datetime(2026, 11, 28, 12, 0, tzinfo=dt.UTC)
SETTLED = {"_id": "inv-1", "status": "settled"}


class World:
    """The test's collection: what a find returns, and when."""

    def __init__(self) -> None:
        self.docs: dict[Any, dict[str, Any]] = {}
        self.finds: list[tuple[str, dict[str, Any]]] = []
        self.now = T0

    def find(self, collection: str, predicate: dict[str, Any]) -> dict[str, Any] | None:
        self.finds.append((collection, predicate))
        doc = self.docs.get(predicate["_id"])
        if doc is None:
            return None
        matches = all(doc.get(k) == v for k, v in predicate.items())  # the test's own rule
        return dict(doc) if matches else None


def run(store: MemorySteps, attempt: int, handler: Any) -> Any:
    steps = RunSteps(store, list(store.recorded), run_id=f"run-{attempt}", attempt=attempt)
    return asyncio.run(handler(steps))


async def settle(steps: RunSteps) -> Any:
    return await steps.wait_until("invoices", {"_id": "inv-1", "status": "settled"}, timeout=60)


def test_a_wait_that_already_holds_does_not_wait_and_records_the_document() -> None:
    world = World()
    world.docs["inv-1"] = dict(SETTLED, total=5)
    store = MemorySteps(clock=lambda: world.now, find=world.find)
    assert run(store, 1, settle) == dict(SETTLED, total=5)
    [entry] = store.recorded
    assert entry["kind"] == "data" and entry["state"] == "done"
    assert entry["collection"] == "invoices" and entry["result"] == dict(SETTLED, total=5)
    assert store.announced == [] and len(world.finds) == 1  # one look, nothing announced
    StepModel.model_validate(entry)


def test_a_wait_announces_itself_before_its_last_look_then_ends_the_run() -> None:
    world = World()
    world.docs["inv-1"] = {"_id": "inv-1", "status": "open"}
    store = MemorySteps(clock=lambda: world.now, find=world.find)
    with pytest.raises(Suspended) as suspended:
        run(store, 1, settle)
    wait = suspended.value.wait
    assert wait.until == T0 + dt.timedelta(seconds=60) and wait.index == 0
    assert wait.data == {
        "collection": "invoices",
        "ids": ["inv-1"],
        "filter": {"_id": "inv-1", "status": "settled"},
    }
    assert len(world.finds) == 2 and len(store.announced) == 1  # looked, announced, looked
    Waiting.model_validate(store.announced[0])
    assert store.announced[0]["data"] == wait.data
    assert wait.entry is not None and wait.entry["state"] == "waiting"
    store.recorded.append(wait.entry)  # the WAITING write records it
    world.docs["inv-1"]["status"] = "settled"
    world.now += dt.timedelta(seconds=5)
    assert run(store, 2, settle) == SETTLED  # woken: the replay looks and finds it
    assert store.recorded[0]["state"] == "done" and store.recorded[0]["attempts"] == 1


def test_a_change_between_the_first_look_and_the_announce_is_found_by_the_last_look() -> None:
    world = World()
    world.docs["inv-1"] = {"_id": "inv-1", "status": "open"}
    looks = 0

    def find(collection: str, predicate: dict[str, Any]) -> dict[str, Any] | None:
        nonlocal looks
        looks += 1
        if looks == 2:  # it changed right after the first look
            world.docs["inv-1"]["status"] = "settled"
        return world.find(collection, predicate)

    store = MemorySteps(clock=lambda: world.now, find=find)
    assert run(store, 1, settle) == SETTLED


def test_a_wait_times_out_on_the_servers_clock_and_its_replay_raises_again() -> None:
    world = World()
    store = MemorySteps(clock=lambda: world.now, find=world.find)
    with pytest.raises(Suspended) as suspended:
        run(store, 1, settle)
    store.recorded.append(dict(suspended.value.wait.entry or {}))
    world.now += dt.timedelta(seconds=61)
    with pytest.raises(ConditionTimeout):
        run(store, 2, settle)
    assert store.recorded[0]["state"] == "timed_out"
    with pytest.raises(SignalTimeout):  # a durable wait's timeout: one except catches both
        run(store, 3, settle)


def test_a_wait_without_a_timeout_waits_until_never() -> None:
    store = MemorySteps(clock=lambda: T0, find=lambda c, p: None)

    async def forever(steps: RunSteps) -> Any:
        return await steps.wait_until("invoices", {"_id": 1})

    with pytest.raises(Suspended) as suspended:
        run(store, 1, forever)
    assert suspended.value.wait.until == NEVER


def test_waits_are_steps_named_by_collection_and_replayed_in_order() -> None:
    world = World()
    world.docs[1] = {"_id": 1}
    world.docs[2] = {"_id": 2}
    store = MemorySteps(clock=lambda: world.now, find=world.find)

    async def two(steps: RunSteps) -> Any:
        await steps.wait_until("invoices", {"_id": 1})
        await steps.wait_until("invoices", {"_id": 2})
        return [s["name"] for s in steps.recorded]

    assert run(store, 1, two) == ["until:invoices", "until:invoices#2"]

    async def other(steps: RunSteps) -> Any:
        return await steps.wait_for("paid")

    with pytest.raises(StepMismatch):
        run(store, 2, other)


@pytest.mark.parametrize(
    ("predicate", "says"),
    [
        ({"status": "settled"}, "names the document's _id"),
        ({"_id": {"$gt": 1}}, "a value, $eq or $in"),
        ({"_id": {"$in": []}}, "1 to 1000"),
        ({"_id": [1, 2]}, "never an array"),
        ({"_id": 1, "$where": "true"}, "cannot use $where"),
        (["_id"], "a mapping"),
        ({"_id": object()}, "must be BSON"),
    ],
)
def test_a_predicate_that_cannot_be_followed_is_a_step_error(predicate: Any, says: str) -> None:
    with pytest.raises(StepError, match=says.replace("$", r"\$")):
        wait_ids(predicate)


@given(st.lists(st.integers(-(2**63), 2**63 - 1) | st.text(max_size=8), min_size=1, max_size=20))
def test_the_ids_a_predicate_names(ids: list[Any]) -> None:
    assert wait_ids({"_id": {"$in": ids}, "status": "x"}) == ids
    assert wait_ids({"_id": ids[0]}) == [ids[0]]
    assert wait_ids({"_id": {"$eq": ids[0]}}) == [ids[0]]
    assert wait_ids({"_id": {"a": 1}}) == [{"a": 1}]  # a document as _id: a value


def test_a_collection_mtask_cannot_follow_is_a_step_error() -> None:
    store = MemorySteps(clock=lambda: T0, find=lambda c, p: None)

    async def bad(steps: RunSteps) -> Any:
        return await steps.wait_until("system.profile", {"_id": 1})

    with pytest.raises(StepError, match="collection"):
        run(store, 1, bad)


def test_memory_steps_must_be_told_what_a_wait_finds() -> None:
    with pytest.raises(StepError, match="find="):
        run(MemorySteps(), 1, settle)


# -- the writes it asks for, read without I/O -------------------------------------------------


def test_the_waiting_outcome_of_a_woken_data_wait_is_claimable_now() -> None:
    store = MemorySteps(clock=lambda: T0, find=lambda c, p: None)
    with pytest.raises(Suspended) as suspended:
        run(store, 1, settle)
    wait = suspended.value.wait
    _, pipeline = finish_update(Outcome("k", "run-1", RunState.WAITING, wait=wait), T0)
    sets = pipeline[0]["$set"]
    woke, now, until = sets["available_at"]["$cond"]
    assert now == T0 and until == wait.until
    assert {"$eq": ["$waiting.index", 0]} in woke["$and"]
    assert sets["waiting"] == {"$literal": wait.to_document()}


def test_a_wake_up_is_one_update_as_a_signals_and_marks_a_run_still_deciding() -> None:
    tasks = [{"_id": "t1", "waiting": {"index": 2, "data": {"filter": {}, "ids": [1]}}}]

    def check(call: Any) -> None:
        filt, pipeline = call.args
        assert filt["$and"] == [{"$or": [{"_id": "t1", "waiting.index": 2}]}, datawaits.NOT_WOKEN]
        sets = pipeline[0]["$set"]
        assert sets["next_claim_at"]["$cond"][1] == "$$NOW"
        assert sets["waiting"]["$mergeObjects"][1]["data"]["$mergeObjects"][1] == {"woke": "$$NOW"}

    class Result:
        modified_count = 1

    driver = ScriptedDriver(Step("update_many", Result(), check=check))
    assert driver.run(datawaits.wake(tasks)) == 1
    assert ScriptedDriver().run(datawaits.wake([])) == 0


def test_the_tasks_a_change_wakes_are_found_through_the_index_and_checked_by_mongodb() -> None:
    well = {"_id": "t1", "waiting": {"index": 0, "data": {"filter": {"_id": 1}, "ids": [1]}}}
    odd = {"_id": "t2", "waiting": {"index": "x"}}

    def found(call: Any) -> None:
        assert call.kwargs == {"hint": datawaits.INDEX_NAME}
        assert call.args[0][datawaits.IDS] == {"$in": [1]}

    def facet(call: Any) -> None:
        [command] = call.args
        assert command["aggregate"] == "invoices"
        assert command["pipeline"][0] == {"$match": {"_id": {"$in": [1]}}}
        assert command["pipeline"][1]["$facet"]["0"][0] == {"$match": {"_id": 1}}

    driver = ScriptedDriver(
        Step("find", [well, odd], check=found),
        Step("command", {"cursor": {"firstBatch": [{"0": [{"_id": 1}]}]}}, check=facet),
    )
    tasks = driver.run(datawaits.waiting_on("invoices", [1]))
    assert tasks == [well]  # a wait of any other shape is skipped
    assert driver.run(datawaits.holding("invoices", [*tasks, odd])) == [well]


def test_a_users_test_runs_a_waiting_handler_with_run_handler() -> None:
    """``mtask.testing.run_handler`` with ``MemorySteps(find=...)``: the run waits, the test
    settles the document, the next run returns (docs/triggers.md, "Waits on data")."""
    from mtask.registry import Registry, TaskContext
    from mtask.testing import run_handler

    registry = Registry()
    registry.waits_on("invoices")

    @registry.task("checkout")
    async def checkout(params: dict[str, Any], ctx: TaskContext) -> str:
        invoice = await ctx.wait_until("invoices", {"_id": "inv-1", "status": "settled"})
        return str(invoice["by"])

    world = World()
    world.docs["inv-1"] = {"_id": "inv-1", "status": "open"}
    steps = MemorySteps(clock=lambda: world.now, find=world.find)
    first = run_handler(registry, "checkout", steps=steps)
    assert first.state is RunState.WAITING and first.wait is not None
    assert first.wait.data is not None and first.wait.data["collection"] == "invoices"
    world.docs["inv-1"] = {"_id": "inv-1", "status": "settled", "by": "ann"}
    second = run_handler(registry, "checkout", steps=steps)
    assert second.state is RunState.SUCCESS and second.result == "ann"
