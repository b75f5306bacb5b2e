"""``ctx.continue_as_new`` in the engine and under ``mtask.testing.run_handler`` (no MongoDB):
the run ends CONTINUED with the new params and the signals its journal took; misuse is a
``StepError``; a spawn's children in a later journal carry their own generation."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from mtask import Registry, RunState, TaskContext
from mtask.steps import MemorySteps, RunSteps, StepError, Suspended
from mtask.steps.children import Spawn, spawn_plan
from mtask.testing import run_handler

registry = Registry()


@registry.task("loop")
async def loop(params: dict[str, Any], ctx: TaskContext) -> Any:
    await ctx.step("poll", lambda: params["n"])
    if params["n"] < 2:
        ctx.continue_as_new({"n": params["n"] + 1})
    return params["n"]


def test_run_handler_returns_continued_with_the_new_params() -> None:
    outcome = run_handler(registry, "loop", {"n": 0}, steps=MemorySteps())
    assert outcome.state is RunState.CONTINUED and outcome.renew is not None
    assert outcome.renew["params"] == {"n": 1}
    last = run_handler(registry, "loop", {"n": 2}, steps=MemorySteps())  # a new journal
    assert last.state is RunState.SUCCESS and last.result == 2


def test_the_signals_a_journals_waits_took_are_counted_by_name() -> None:
    store = MemorySteps()
    store.signal("go", 1)
    store.signal("go", 2)
    store.signal("stop", 3)
    steps = RunSteps(store, [], run_id="r1", attempt=1)

    async def body() -> None:
        await steps.wait_for("go")
        await steps.wait_for("go")
        await steps.wait_for("stop")
        steps.continue_as_new({"x": 1})

    with pytest.raises(Suspended) as raised:
        asyncio.run(body())
    assert raised.value.wait.renew == {
        "params": {"x": 1},
        "taken": [{"name": "go", "n": 2}, {"name": "stop", "n": 1}],
    }


@pytest.mark.parametrize(
    ("params", "said"),
    [([1], "a mapping"), ({"f": object()}, "must be BSON")],
)
def test_bad_params_are_a_step_error(params: Any, said: str) -> None:
    steps = RunSteps(MemorySteps(), [], run_id="r1", attempt=1)
    with pytest.raises(StepError, match=said):
        steps.continue_as_new(params)


def test_a_later_journals_children_are_its_own_generation() -> None:
    """A journal after a continue spawns under the step's name again: the earlier journal's
    children exist, so its own carry the run's generation (``spawn#1@<run>``)."""
    store = MemorySteps()
    first = RunSteps(store, [], run_id="r1", attempt=1)
    with pytest.raises(Suspended):
        first.run_plan_sync(spawn_plan(first, "p", [Spawn("leaf", {})], None))
    store.finish("p/spawn#1/0", 1)
    store.recorded.clear()  # the journal continued as new: an empty one
    later = RunSteps(store, [], run_id="run-2222-3333", attempt=2)
    with pytest.raises(Suspended) as raised:
        later.run_plan_sync(spawn_plan(later, "p", [Spawn("leaf", {})], None))
    assert raised.value.wait.children == "spawn#1@run22223333"
    assert sorted(store.tasks) == ["p/spawn#1/0", "p/spawn#1@run22223333/0"]
    assert (
        store.recorded[0]["name"] == "spawn#1" and store.recorded[0]["tag"] == "spawn#1@run22223333"
    )
