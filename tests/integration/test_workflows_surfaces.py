"""Issue 61's workflows seen and steered from outside: ``mtask get`` shows a parent waiting for
its children (how many finished), a child's parent and place, a parallel step's gather and a
task's deadline; the dashboard's task page and step timeline show them too, and a task's
derived state is ``waiting`` for ``children``; ``mtask step rename|drop|check`` and ``mtask
retry --from-step`` (bad input: exit 2, nothing written), ``POST /tasks/{key}:remark`` and
``POST /tasks/{key}:retry`` with ``from_step`` (404, 409, 422 as for a reset); the events API
carries the wait for children."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
from pathlib import Path
from typing import Any

import pytest
import workflowapp
from fastapi.testclient import TestClient
from harness import run_cli, running_worker

from mtask import AsyncTaskClient
from mtask.registry import Registry, TaskContext
from mtask.steps.children import Spawn
from mtask.web import create_app

TOKEN = "test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
TESTS = Path(__file__).resolve().parents[1]
registry = Registry()


@registry.task("child")
async def child(params: dict[str, Any], ctx: TaskContext) -> int:
    await ctx.wait_for("go")
    return int(params["n"])


@registry.task("parent")
async def parent(params: dict[str, Any], ctx: TaskContext) -> Any:
    await ctx.gather(ctx.step("a", lambda: 1), ctx.step("b", lambda: 2))
    return await ctx.spawn_and_wait([Spawn("child", {"n": n}) for n in range(3)], name="kids")


async def test_a_parent_and_its_children_in_get_the_dashboard_and_the_api(
    aclient: AsyncTaskClient, mongo_uri: str, db_name: str
) -> None:
    common = ("--uri", mongo_uri, "--database", db_name)
    deadline = dt.datetime(2046, 1, 1, tzinfo=dt.UTC)
    async with running_worker(registry, mongo_uri, db_name, concurrency=4) as (_, events):
        await aclient.publish("parent", "p1", {}, options={"deadline": deadline})
        await events.wait("recorded", key="p1", state="WAITING")
        for n in range(3):
            await events.wait("recorded", key=f"p1/kids/{n}", state="WAITING")
        await aclient.signal("p1/kids/0", "go")
        await events.wait("recorded", key="p1/kids/0", state="SUCCESS")
        await _counted(aclient, "p1", 1)

        code, out, _ = await asyncio.to_thread(run_cli, "get", "p1", *common, width=200)
        assert code == 0, out
        assert "waiting for its children: 1 of 3 children finished (step 3: kids)" in out
        assert "spawned    1 of 3 finished (step kids; mtask flow p1)" in out
        assert "deadline" in out and "2046-01-01" in out
        assert "parallel (gather#1)" in out and "3 children" in out
        code, out, _ = await asyncio.to_thread(run_cli, "get", "p1/kids/2", *common, width=200)
        assert "p1 (spawned by step kids, child 3)" in out

        with TestClient(create_app(mongo_uri, database=db_name, token=TOKEN)) as http:
            task = http.get("/tasks/p1", headers=AUTH).json()
            assert task["state"] == "waiting" and task["why"] == "children"
            assert task["waiting"]["children"] == "kids" and task["spawned"]["done"] == 1
            from mtask.web.auth import COOKIE, Keys

            http.cookies.set(COOKIE, Keys.of(TOKEN).new_session())
            page = http.get("/ui/tasks/p1").text
            assert "waiting for its children: 1 of 3 children finished (step 3: kids)" in page
            assert "parallel (gather#1)" in page and "3 children" in page
            assert 'id="deadline"' in page
            page = http.get("/ui/tasks/p1%2Fkids%2F1").text
            assert "spawned by its step kids, child 2" in page

        for n in (1, 2):
            await aclient.signal(f"p1/kids/{n}", "go")
        async with asyncio.timeout(30):
            done = await aclient.wait("p1")
    assert done.result == [0, 1, 2]


async def _counted(aclient: AsyncTaskClient, key: str, done: int) -> None:
    async with asyncio.timeout(20):
        while True:
            task = await aclient.get(key)
            if task is not None and task.spawned is not None and task.spawned.done >= done:
                return
            await asyncio.sleep(0.05)


@registry.task("two_steps")
async def two_steps(params: dict[str, Any], ctx: TaskContext) -> str:
    await ctx.step("one", lambda: 1)
    await ctx.step("two", lambda: 2)
    if params.get("fail"):
        raise RuntimeError("fails after its steps")
    await ctx.wait_for("go")
    return "ok"


async def test_the_cli_and_the_api_change_a_parked_journal(
    aclient: AsyncTaskClient, mongo_uri: str, db_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    common = ("--uri", mongo_uri, "--database", db_name)
    async with running_worker(registry, mongo_uri, db_name) as (_, events):
        await aclient.publish("two_steps", "j1", {})
        await aclient.publish("two_steps", "j2", {"fail": True}, options={"max_retries": 0})
        await events.wait("recorded", key="j1", state="WAITING")
        await events.wait("recorded", key="j2", state="FAIL")

        code, out, _ = await asyncio.to_thread(
            run_cli, "step", "rename", "j1", "one", "first", *common
        )
        assert code == 0 and "renamed one to first: j1 (step 1)" in out
        code, _, err = await asyncio.to_thread(run_cli, "step", "drop", "j1", "ghost", *common)
        assert code == 2 and "no step 'ghost'" in err
        code, out, _ = await asyncio.to_thread(
            run_cli, "steps", "drop", "j1", "two", "--json", *common
        )
        assert code == 0 and json.loads(out) == {
            "key": "j1", "step": "two", "to": None, "index": 1, "woke": False
        }  # fmt: skip
        with TestClient(create_app(mongo_uri, database=db_name, token=TOKEN)) as http:
            answer = http.post(
                "/tasks/j1:remark", json={"step": "first", "to": "one"}, headers=AUTH
            )
            assert answer.status_code == 200 and answer.json()["to"] == "one"
            answer = http.post("/tasks/j1:remark", json={"step": "nope"}, headers=AUTH)
            assert answer.status_code == 422
            answer = http.post("/tasks/ghost:remark", json={"step": "one"}, headers=AUTH)
            assert answer.status_code == 404
            answer = http.post("/tasks/j1:remark", json={"step": "one", "extra": 1}, headers=AUTH)
            assert answer.status_code == 422
            answer = http.post("/tasks/j2:retry", json={"from_step": "nope"}, headers=AUTH)
            assert answer.status_code == 422
            answer = http.post("/tasks/j1:retry", json={"from_step": "one"}, headers=AUTH)
            assert answer.status_code == 409  # pending: not failed or cancelled
        code, out, _ = await asyncio.to_thread(
            run_cli, "retry", "j2", "--from-step", "two", *common
        )
        assert code == 0 and "the steps before it are kept and replayed: one" in out, (out, _)
        code, _, err = await asyncio.to_thread(
            run_cli, "retry", "--name", "two_steps", "--from-step", "two", *common
        )
        assert code == 2 and "one task" in err
        await events.wait("recorded", key="j2", state="FAIL", count=2)
    task = await aclient.get("j1")
    assert task is not None and [s.name for s in task.steps] == ["one", "wait:go"]

    monkeypatch.chdir(TESTS)  # mtask step check imports workflowapp from here
    workflowapp.EFFECTS.update(uri=mongo_uri, db=db_name)
    async with running_worker(workflowapp.v1, mongo_uri, db_name) as (_, events):
        await aclient.publish("ship_order", "s1", {})
        await events.wait("recorded", key="s1", state="WAITING")
    code, out, _ = await asyncio.to_thread(
        run_cli, "step", "check", "workflowapp:v3", "--name", "ship_order", *common, width=200
    )
    assert code == 1, out  # a task would mismatch
    assert "mismatch: s1 at step 2" in out and "nothing written" in out
    code, out, _ = await asyncio.to_thread(
        run_cli, "step", "check", "workflowapp:v2", "--name", "ship_order", "--json", *common
    )
    assert code == 0 and json.loads(out)["names"]["ship_order"]["clean"] == 1
    code, _, err = await asyncio.to_thread(run_cli, "step", "check", "nowhere:app", *common)
    assert code == 2 and "cannot import" in err


@registry.task("small_parent")
async def small_parent(params: dict[str, Any], ctx: TaskContext) -> Any:
    await ctx.gather(ctx.step("x", lambda: 1), ctx.step("y", lambda: 2))
    return await ctx.spawn_and_wait([("child", {"n": 5})], name="one")


async def test_the_events_api_carries_the_wait_for_children_and_the_parallel_steps(
    aclient: AsyncTaskClient, mongo_uri: str, db_name: str
) -> None:
    from mtask.follow.events import events as events_of

    seen: list[Any] = []
    opened = asyncio.Event()

    async def follow() -> None:
        async for event in events_of(
            aclient.collection, ["small_parent"], opened=opened, steps=True
        ):
            seen.append(event)
            if event.waiting is not None and event.waiting.get("children") == "one":
                return

    follower = asyncio.create_task(follow())
    await opened.wait()
    async with running_worker(registry, mongo_uri, db_name):
        await aclient.publish("small_parent", "e1", {})
        await asyncio.wait_for(follower, 30)
    written = [s for e in seen for s in e.steps]
    assert {s["name"] for s in written} >= {"x", "y", "one"}
    assert {s.get("group") for s in written if s["name"] in ("x", "y")} == {"gather#1"}
    spawn = next(s for s in written if s["name"] == "one")
    assert (spawn["kind"], spawn["total"]) == ("children", 1)
