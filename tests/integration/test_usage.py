"""Usage and cost, measured, and budgets (docs/usage.md), with a real worker on a real replica
set: ``ctx.record_usage`` charges the run, its task, its name and its group (priced from the
registry's table), Prometheus counts it, a task's budget stops the next step and fails the
task naming it, and a task that records nothing pays nothing."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import usageapp
from fastapi.testclient import TestClient
from harness import running_worker, wait_for, worker_process
from harness.cli import run_cli
from prometheus_client import REGISTRY
from pymongo import AsyncMongoClient

from mtask import AsyncTaskClient
from mtask.driver import AsyncDriver, collections
from mtask.registry import Registry, Retry, TaskContext
from mtask.store import usage as store_usage
from mtask.web import create_app
from mtask.worker.running.usage_stores import Budgets

APP = "usageapp:registry"
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
    # nano-units: (600 x 1 + 400 x 0.5 + 200 x 4 + 2000 x 1 + 100 x 4) per million tokens
    small = 4_000_000
    usage = task.usage
    assert (usage.input_tokens, usage.output_tokens, usage.cached_tokens) == (3050, 305, 400)
    assert usage.requests == 3 and usage.cost_nanos == small and str(usage.cost) == "0.004000000"
    by_model = {m.model: m for m in usage.models}
    assert by_model["small"].input_tokens == 3000 and by_model["small"].requests == 2
    assert by_model["big"].cost_nanos is None and by_model["big"].output_tokens == 5  # no price
    assert task.runs[-1].usage is not None and task.runs[-1].usage.input_tokens == 3050
    assert threaded.usage.requests == 3 and threaded.usage.cost_nanos == 14_000 + 250_000_000
    async with AsyncMongoClient[dict[str, Any]](mongo_uri) as mongo:
        found = mongo[db_name]["tasks.usage"].find({})
        scopes = {(d["_id"]["scope"], d["_id"]["id"]): d async for d in found}
    assert scopes[("group", "acme")]["input_tokens"] == 3050 + 1000
    assert scopes[("name", "chat")]["output_tokens"] == 305 + 200
    assert scopes[("name", "chat")]["requests"] == 4 == task.usage.requests + other.usage.requests
    acme = scopes[("group", "acme")]["cost_nanos"]
    assert acme == task.usage.cost_nanos + other.usage.cost_nanos  # exact: integers
    assert scopes[("group", "other")]["requests"] == 3
    input_small = _sample("mtask_tokens_total", name="chat", model="small", kind="input")
    assert input_small - before_tokens == 3000 + 1000
    cost_small = _sample("mtask_cost_total", name="chat", model="small")
    assert abs(cost_small - before_cost - (small + other.usage.cost_nanos) / 1e9) < 1e-12


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
        await aclient.publish("spender", "b3", {"steps": 5}, options={"budget": {"cost": 0.0002}})
        task = await _finished(aclient, "b1")
        under = await _finished(aclient, "b2")
        money = await _finished(aclient, "b3")
    assert task.status.value == "failed" and task.failed_permanently, task
    assert task.error is not None and "the task budget of 250 tokens" in task.error
    assert "300 tokens spent" in task.error
    assert [s.name for s in task.steps] == ["call0", "call1", "call2"]  # call3 never started
    assert [c for c in CALLED if c.startswith("b1:")] == ["b1:call0", "b1:call1", "b1:call2"]
    assert task.usage.input_tokens + task.usage.output_tokens == 300
    assert len(task.runs) == 1  # a budget spent is for good: no retry
    assert under.status.value == "succeeded" and under.usage.requests == 2
    # in money: one step costs 60 x 1 + 40 x 4 per million (0.00022): the second never starts
    assert money.status.value == "failed" and [s.name for s in money.steps] == ["call0"]
    assert "the task budget of a cost of 0.0002 (100 tokens, a cost of 0.00022 spent)" in (
        money.error or ""
    )


@registry.task("retried_spender", options={"retry_delay_ms": 0})
async def retried_spender(params: dict[str, Any], ctx: TaskContext) -> int:
    for n in range(5):
        counts = {"input_tokens": 60, "output_tokens": 40}
        await ctx.step(f"call{n}", _ask, ctx, f"{ctx.key}:call{n}", "small", **counts)
        if n == 1 and ctx.attempt == 1:
            raise Retry("again")
    return 5


async def test_a_tasks_budget_counts_what_its_earlier_runs_spent(
    aclient: AsyncTaskClient, mongo_uri: str, db_name: str
) -> None:
    """The second run replays two steps (charging nothing again) and counts the 200 tokens
    and 0.00044 the first run spent (its claim reads them) against the task's budget."""
    async with running_worker(registry, mongo_uri, db_name):
        await aclient.publish("retried_spender", "t1", {}, options={"budget": {"tokens": 250}})
        await aclient.publish("retried_spender", "t2", {}, options={"budget": {"cost": 0.0006}})
        tokens = await _finished(aclient, "t1")
        money = await _finished(aclient, "t2")
    for task in (tokens, money):
        assert task.status.value == "failed" and len(task.runs) == 2, task
        assert [s.name for s in task.steps] == ["call0", "call1", "call2"]
        assert task.usage.requests == 3 and task.runs[-1].usage.requests == 1
    assert "(300 tokens spent)" in (tokens.error or "")
    assert "a cost of 0.00066 spent" in (money.error or "")


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


async def _registered(aclient: AsyncTaskClient, count: int) -> bool:
    return len(await aclient.workers()) >= count


async def test_a_groups_budget_raced_by_four_worker_processes_stops_new_steps_within_the_bound(
    aclient: AsyncTaskClient, mongo_uri: str, db_name: str
) -> None:
    """4 worker processes of concurrency 2 race on one group's budget of 1000 tokens: steps
    stop once it is reached, a step that started is never cut off (each one that said it
    started was charged), and the total is under the documented bound: the budget plus one
    step's tokens per run in flight (4 x 2)."""
    await aclient.set_budget(group="tenant", tokens=1000)
    keys = [f"r{i}" for i in range(8)]
    argv = ("--concurrency", "2")
    with contextlib.ExitStack() as stack:
        for _ in range(4):
            stack.enter_context(worker_process(mongo_uri, db_name, *argv, app=APP))
        await wait_for(lambda: _registered(aclient, 4), timeout=60, every=0.2)  # all four race
        for key in keys:
            await aclient.publish("racer", key, {"steps": 10}, options={"group": "tenant"})
        tasks = [await _finished(aclient, key) for key in keys]
    [scope] = await aclient.usage(group="tenant")
    total = scope["input_tokens"] + scope["output_tokens"]
    assert total == sum(t.usage.input_tokens + t.usage.output_tokens for t in tasks if t.usage)
    in_flight_at_most = 4 * 2  # workers x concurrency: one step per running task
    assert 1000 <= total <= 1000 + in_flight_at_most * usageapp.STEP_TOKENS, total
    for task in tasks:  # every step that started finished and was charged: none was cut off
        started = [e for e in await aclient.output(task.key) if e.message == "started"]
        charged = task.usage.requests if task.usage else 0
        assert len(started) == len(task.steps) == charged, task
        assert all(s.state == "done" for s in task.steps)
    failed = [t for t in tasks if t.status.value == "failed"]
    assert failed and all(
        "the group 'tenant' budget of 1000 tokens" in (t.error or "") for t in failed
    )
    assert sum(len(t.steps) for t in tasks) < 80  # the budget stopped steps


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


async def test_usage_is_shown_by_mtask_get_rest_and_the_dashboard_and_budgets_set_over_rest(
    aclient: AsyncTaskClient, mongo_uri: str, db_name: str
) -> None:
    async with running_worker(registry, mongo_uri, db_name):
        await aclient.publish(
            "chat",
            "s1",
            {"calls": [["small", 1000, 200, 400], ["big", 50, 5, 0]]},
            options={"group": "acme", "budget": {"tokens": 90_000}},
        )
        await _finished(aclient, "s1")
    code, out, _ = run_cli("get", "s1", "--uri", mongo_uri, "--database", db_name, width=160)
    assert code == 0, out
    assert "1,255 tokens (1,050 in, 400 cached, 205 out), 2 requests, cost 0.0016" in out
    assert "small" in out and "big" in out and "90000 tokens (the task)" in out
    assert "1,255 tok, 0.0016 " in out  # the run's usage in the runs table

    def rest() -> None:
        with TestClient(create_app(mongo_uri, database=db_name, token="t")) as http:
            auth = {"Authorization": "Bearer t"}
            task = http.get("/tasks/s1", headers=auth).json()
            assert (
                task["usage"]["input_tokens"] == 1050 and task["usage"]["cost_nanos"] == 1_600_000
            )
            assert task["runs"][-1]["usage"]["requests"] == 2
            assert task["options"]["budget"]["tokens"] == 90_000
            [acme] = http.get("/usage", params={"group": "acme"}, headers=auth).json()
            assert (acme["scope"], acme["id"], acme["output_tokens"]) == ("group", "acme", 205)
            assert acme["cost_nanos"] == 1_600_000
            put = http.put("/budgets/group/acme", json={"cost": 5, "period": "day"}, headers=auth)
            assert put.status_code == 200 and put.json()["budget"]["cost_nanos"] == 5 * 10**9
            bad = http.put("/budgets/group/acme", json={"period": "day"}, headers=auth)
            assert bad.status_code in (400, 422) and "at least one" in bad.text
            bad = http.put("/budgets/group/acme", json={"tokens": -1}, headers=auth)
            assert bad.status_code == 422
            assert http.put("/budgets/team/x", json={"tokens": 1}, headers=auth).status_code == 422
            assert http.delete("/budgets/group/acme", headers=auth).status_code == 204
            assert http.delete("/budgets/group/acme", headers=auth).status_code == 404
            page = http.get("/ui/tasks/s1", headers=auth).text
            assert 'id="usage"' in page and "1,255 tokens" in page and "90000 tokens" in page

    await asyncio.to_thread(rest)


class _Counted(AsyncDriver):
    """A driver that keeps each call made to the usage collection."""

    def __init__(self, collections: Any) -> None:
        super().__init__(collections)
        self.usage_calls: list[str] = []

    async def _call(self, call: Any, session: Any) -> Any:
        if call.collection == "usage":
            self.usage_calls.append(call.method)
        return await super()._call(call, session)


async def test_without_budgets_a_worker_reads_one_key_a_period_whatever_its_scopes(
    aclient: AsyncTaskClient, mongo_uri: str, db_name: str
) -> None:
    """Budgets nobody set cost one read of an empty index per period per worker, not one read
    per name and group; a budget set later is heard within the period."""
    amongo: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(mongo_uri, tz_aware=True)
    try:
        driver = _Counted(collections(amongo[db_name]))
        budgets = Budgets(driver, ttl=0.5)
        scopes = [store_usage.scope_id("group", f"g{i}") for i in range(20)]
        for scope in scopes:
            assert not await budgets.any_of([store_usage.scope_id("name", "n"), scope])
        assert driver.usage_calls == ["create_indexes", "find_one"]  # no read per scope
        await aclient.set_budget(group="g7", tokens=10)

        async def heard() -> bool:
            return await budgets.any_of([scopes[7]])

        await wait_for(heard, timeout=10, every=0.1)
        assert "find" in driver.usage_calls  # some budget: the scopes' are read
        assert not await budgets.any_of([scopes[3]])
    finally:
        await amongo.close()
