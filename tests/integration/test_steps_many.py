"""A task with 1,000 steps, the most a task records (not tested before): every step
runs once across a retry and two sleeps, the replays read the journal back in order, the task
document holds it, and a step past the limit fails the task clearly."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import bson
from harness import running_worker

from mtask import AsyncTaskClient
from mtask.registry import Registry, TaskContext
from mtask.steps import MAX_STEPS

registry = Registry()
CALLS: Counter[int] = Counter()
STEPS = MAX_STEPS - 2  # and two sleeps: 1,000 steps in all
FAIL_AT = 600


def work(i: int) -> int:
    CALLS[i] += 1
    if i == FAIL_AT and CALLS[i] == 1:
        raise RuntimeError(f"step {i} fails once")
    return i * i


@registry.task("thousand", options={"retry_delay_ms": 0, "max_retries": 2})
async def thousand(params: dict[str, Any], ctx: TaskContext) -> dict[str, Any]:
    total = 0
    for i in range(STEPS):
        total += await ctx.step(f"s{i}", work, i)
        if i in (250, 800):
            await ctx.sleep(0.01)  # ends the run: the next one replays every step before it
    if params.get("one_more"):
        await ctx.step("past the limit", work, -1)
    return {"total": total, "attempt": ctx.attempt}


async def test_a_task_with_a_thousand_steps_runs_each_once(
    aclient: AsyncTaskClient, mongo_uri: str, db_name: str
) -> None:
    CALLS.clear()
    async with running_worker(registry, mongo_uri, db_name):
        await aclient.publish("thousand", "t1000", {})
        async with asyncio.timeout(120):
            task = await aclient.wait("t1000")
    assert task.status.value == "succeeded", task.error
    assert task.result == {"total": sum(i * i for i in range(STEPS)), "attempt": 4}
    assert CALLS[FAIL_AT] == 2 and all(CALLS[i] == 1 for i in range(STEPS) if i != FAIL_AT)
    names = [s.name for s in task.steps if s.name[1:].isdigit()]
    assert names == [f"s{i}" for i in range(STEPS)]
    assert [s.name for s in task.steps if s.name.startswith("sleep")] == ["sleep#1", "sleep#2"]
    # two sleeps and a failure: four runs, each replaying what came before it
    assert [r.state.value for r in task.runs] == ["WAITING", "FAIL", "WAITING", "SUCCESS"]
    assert len(task.steps) == MAX_STEPS
    raw = await aclient.collection.find_one({"_id": "t1000"})
    assert raw is not None and len(bson.encode(raw)) < 1024 * 1024  # far from 16 MiB


async def test_a_step_past_the_limit_fails_the_task_for_good(
    aclient: AsyncTaskClient, mongo_uri: str, db_name: str
) -> None:
    CALLS.clear()
    CALLS[FAIL_AT] = 1  # no planned failure this time
    async with running_worker(registry, mongo_uri, db_name):
        await aclient.publish("thousand", "t1001", {"one_more": True})
        async with asyncio.timeout(120):
            task = await aclient.wait("t1001")
    assert task.status.value == "failed"
    assert task.error == (
        f"StepError: a task records at most {MAX_STEPS} steps (a loop without end continues "
        "as new: ctx.continue_as_new)"
    )
    assert len(task.steps) == MAX_STEPS and CALLS[-1] == 0
