"""Usage and cost, measured, and budgets (docs/usage.md), with a real worker on a real replica
set: ``ctx.record_usage`` charges the run, its task, its name and its group (priced from the
registry's table), Prometheus counts it, a task's budget stops the next step and fails the
task naming it, and a task that records nothing pays nothing."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from harness import running_worker
from prometheus_client import REGISTRY
from pymongo import AsyncMongoClient

from mtask import AsyncTaskClient
from mtask.registry import Registry, TaskContext

registry = Registry()
registry.price("small", input=1.0, output=4.0, cached=0.5)  # per million tokens
CALLED: list[str] = []


async def _ask(ctx: TaskContext, label: str, model: str, **counts: int) -> None:
    """A model's call: its usage charged inside the step's function (once per call)."""
    CALLED.append(label)
    await ctx.record_usage(model, **counts)


@registry.task("chat")
async def chat(params: dict[str, Any], ctx: TaskContext) -> int:
    for n, (model, inp, out, cached) in enumerate(params["calls"]):
        counts = {"input_tokens": inp, "output_tokens": out, "cached_tokens": cached}
        await ctx.step(f"ask{n}", _ask, ctx, f"{ctx.key}:{n}", model, **counts)
    return len(params["calls"])


@registry.task("threaded_chat")
def threaded_chat(params: dict[str, Any], ctx: TaskContext) -> int:
    ctx.record_usage_sync("small", input_tokens=10, output_tokens=1)
    ctx.record_usage_sync(None, input_tokens=5, requests=2, cost=0.25)
    return 2


@registry.task("plain")
async def plain(params: dict[str, Any]) -> int:
    return 1


def _sample(metric: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(metric, labels) or 0.0


async def _finished(aclient: AsyncTaskClient, key: str) -> Any:
    return await asyncio.wait_for(aclient.wait(key), 60)


async def test_usage_is_totalled_per_run_task_name_and_group(
    aclient: AsyncTaskClient, mongo_uri: str, db_name: str
) -> None:
    calls = [["small", 1000, 200, 400], ["big", 50, 5, 0], ["small", 2000, 100, 0]]
    before_tokens = _sample("mtask_tokens_total", name="chat", model="small", kind="input")
    before_cost = _sample("mtask_cost_total", name="chat", model="small")
    async with running_worker(registry, mongo_uri, db_name):
        await aclient.publish("chat", "u1", {"calls": calls}, options={"group": "acme"})
        await aclient.publish("chat", "u2", {"calls": calls[:1]}, options={"group": "acme"})
        await aclient.publish("threaded_chat", "u3", {}, options={"group": "other"})
        task = await _finished(aclient, "u1")
        other = await _finished(aclient, "u2")
        threaded = await _finished(aclient, "u3")
    assert task.status.value == "succeeded", task
    small = (600 * 1.0 + 400 * 0.5 + 200 * 4.0 + 2000 * 1.0 + 100 * 4.0) / 1e6
    usage = task.usage
    assert (usage.input_tokens, usage.output_tokens, usage.cached_tokens) == (3050, 305, 400)
    assert usage.requests == 3 and abs(usage.cost - small) < 1e-12
    by_model = {m.model: m for m in usage.models}
    assert by_model["small"].input_tokens == 3000 and by_model["small"].requests == 2
    assert by_model["big"].cost is None and by_model["big"].output_tokens == 5  # no price
    assert task.runs[-1].usage is not None and task.runs[-1].usage.input_tokens == 3050
    assert threaded.usage.requests == 3 and abs(threaded.usage.cost - (10 + 4) / 1e6 - 0.25) < 1e-12
    async with AsyncMongoClient[dict[str, Any]](mongo_uri) as mongo:
        found = mongo[db_name]["tasks.usage"].find({})
        scopes = {(d["_id"]["scope"], d["_id"]["id"]): d async for d in found}
    assert scopes[("group", "acme")]["input_tokens"] == 3050 + 1000
    assert scopes[("name", "chat")]["output_tokens"] == 305 + 200
    assert scopes[("name", "chat")]["requests"] == 4 == task.usage.requests + other.usage.requests
    assert abs(scopes[("group", "acme")]["cost"] - task.usage.cost - other.usage.cost) < 1e-12
    assert scopes[("group", "other")]["requests"] == 3
    input_small = _sample("mtask_tokens_total", name="chat", model="small", kind="input")
    assert input_small - before_tokens == 3000 + 1000
    cost_small = _sample("mtask_cost_total", name="chat", model="small")
    assert abs(cost_small - before_cost - small - other.usage.cost) < 1e-12


@registry.task("spender", options={"retry_delay_ms": 0})
async def spender(params: dict[str, Any], ctx: TaskContext) -> int:
    for n in range(params["steps"]):
        counts = {"input_tokens": 60, "output_tokens": 40}
        await ctx.step(f"call{n}", _ask, ctx, f"{ctx.key}:call{n}", "small", **counts)
    return params["steps"]


async def test_a_tasks_budget_stops_the_next_step_and_fails_the_task_naming_it(
    aclient: AsyncTaskClient, mongo_uri: str, db_name: str
) -> None:
    async with running_worker(registry, mongo_uri, db_name):
        await aclient.publish(
            "spender", "b1", {"steps": 5}, options={"budget": {"tokens": 250}, "max_retries": 2}
        )
        await aclient.publish("spender", "b2", {"steps": 2}, options={"budget": {"tokens": 250}})
        task = await _finished(aclient, "b1")
        under = await _finished(aclient, "b2")
    assert task.status.value == "failed" and task.failed_permanently, task
    assert task.error is not None and "the task budget of 250 tokens" in task.error
    assert "300 tokens spent" in task.error
    assert [s.name for s in task.steps] == ["call0", "call1", "call2"]  # call3 never started
    assert [c for c in CALLED if c.startswith("b1:")] == ["b1:call0", "b1:call1", "b1:call2"]
    assert task.usage.input_tokens + task.usage.output_tokens == 300
    assert len(task.runs) == 1  # a budget spent is for good: no retry
    assert under.status.value == "succeeded" and under.usage.requests == 2


async def test_a_task_that_records_no_usage_pays_nothing(
    aclient: AsyncTaskClient, mongo_uri: str, db_name: str
) -> None:
    async with running_worker(registry, mongo_uri, db_name):
        await aclient.publish("plain", "p1", {})
        await aclient.publish("chat", "p2", {"calls": []})
        await _finished(aclient, "p1")
        await _finished(aclient, "p2")
    async with AsyncMongoClient[dict[str, Any]](mongo_uri) as mongo:
        db = mongo[db_name]
        for key in ("p1", "p2"):
            doc = await db["tasks"].find_one({"_id": key})
            assert doc is not None and "usage" not in doc and "budget" not in doc["options"]
            assert all("usage" not in run for run in doc["runs"])
        assert "tasks.usage" not in await db.list_collection_names()


@registry.task("racer", options={"retry_delay_ms": 0})
async def racer(params: dict[str, Any], ctx: TaskContext) -> int:
    for n in range(params["steps"]):
        await ctx.step(f"call{n}", _slow_call, ctx, f"{ctx.key}:call{n}")
    return params["steps"]


async def _slow_call(ctx: TaskContext, label: str) -> None:
    STARTED.append(label)
    await asyncio.sleep(0.02)  # in flight a while: others start meanwhile
    await ctx.record_usage("small", input_tokens=70, output_tokens=30)


STARTED: list[str] = []


async def test_a_groups_budget_raced_by_four_workers_stops_new_steps_within_the_bound(
    aclient: AsyncTaskClient, mongo_uri: str, db_name: str
) -> None:
    await aclient.set_budget(group="tenant", tokens=1000)
    keys = [f"r{i}" for i in range(8)]
    async with contextlib.AsyncExitStack() as stack:
        for _ in range(4):
            await stack.enter_async_context(
                running_worker(registry, mongo_uri, db_name, concurrency=2)
            )
        for key in keys:
            await aclient.publish("racer", key, {"steps": 10}, options={"group": "tenant"})
        tasks = [await _finished(aclient, key) for key in keys]
    [scope] = await aclient.usage(group="tenant")
    total = scope["input_tokens"] + scope["output_tokens"]
    assert total == sum(t.usage.input_tokens + t.usage.output_tokens for t in tasks if t.usage)
    in_flight_at_most = 4 * 2  # workers x concurrency: one step per running task
    assert 1000 <= total < 1000 + in_flight_at_most * 100, total
    for task in tasks:  # every step that started finished and was charged: none was cut off
        started = [s for s in STARTED if s.startswith(f"{task.key}:")]
        assert len(started) == len(task.steps) == (task.usage.requests if task.usage else 0)
        assert all(s.state == "done" for s in task.steps)
    failed = [t for t in tasks if t.status.value == "failed"]
    assert failed and all(
        "the group 'tenant' budget of 1000 tokens" in (t.error or "") for t in failed
    )


@registry.task("periodic", options={"max_retries": 0})
async def periodic(params: dict[str, Any], ctx: TaskContext) -> int:
    for n in range(4):
        await ctx.step(f"call{n}", _ask, ctx, f"{ctx.key}:call{n}", "small", input_tokens=100)
    return 4


async def test_a_per_period_budget_waits_for_the_next_period_holding_no_slot(
    aclient: AsyncTaskClient, mongo_uri: str, db_name: str
) -> None:
    await aclient.set_budget("periodic", tokens=150, period=2)  # per 2 s of the server's clock
    async with running_worker(registry, mongo_uri, db_name, concurrency=1):
        await aclient.publish("periodic", "w1", {})
        await aclient.publish("plain", "w2", {})  # runs while w1 waits: no slot held
        task = await _finished(aclient, "w1")
        other = await _finished(aclient, "w2")
    assert task.status.value == "succeeded", task
    assert task.snoozes and task.snoozes >= 1 and task.failures == 0  # no retry spent
    snoozed = [r for r in task.runs if r.state.value == "SNOOZED"]
    assert all("budget spent for this period" in (r.error or "") for r in snoozed)
    assert [c for c in CALLED if c.startswith("w1:")] == [f"w1:call{n}" for n in range(4)]
    assert other.status.value == "succeeded"
    [scope] = await aclient.usage(name="periodic")
    assert scope["budget"] == {"tokens": 150, "period": 2.0} and scope["input_tokens"] == 400
    first, last = snoozed[0], task.runs[-1]
    assert first.finished_at is not None
    # the run after the snooze began in a later period of 2 s (both times the server's)
    assert int(last.claimed_at.timestamp()) // 2 > int(first.finished_at.timestamp()) // 2
