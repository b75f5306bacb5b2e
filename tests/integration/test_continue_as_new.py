"""Loops without end (``ctx.continue_as_new``) on a real replica set with a real worker: a task
that continues as new 2,000 times keeps its key, its document stays small and it finishes; the
signals its journals took go with them and the others stay; each journal's children are its
own; a plain-def handler in a child process continues as a coroutine does; bad params fail the
task for good, naming the problem."""

from __future__ import annotations

import asyncio
from typing import Any

import bson
import pytest
from fastapi.testclient import TestClient
from harness import run_cli, running_worker
from pymongo import MongoClient

from mtask import AsyncTaskClient
from mtask.models import MAX_JOURNALS_KEPT, RunState
from mtask.registry import Registry, TaskContext
from mtask.steps.children import Spawn
from mtask.web import create_app
from mtask.web.auth import COOKIE, Keys

registry = Registry()

LOOPS = 2000
DOCUMENT_BOUND = 16 * 1024
"""What the document of a task that continued as new 2,000 times (two steps a journal) may
weigh: the journals it left are summarised (the newest ten), its runs folded (the newest 20)."""


@registry.task("poller")
async def poller(params: dict[str, Any], ctx: TaskContext) -> Any:
    n = params["n"]
    seen = await ctx.step("poll", lambda: n + 1)
    await ctx.step("note", lambda: None)  # a second entry in each journal
    if seen < params["until"]:
        ctx.continue_as_new({"n": seen, "until": params["until"]})
    return {"n": seen, "attempt": ctx.attempt}


@pytest.mark.slow  # 2,000 runs, one after another: tens of seconds on a busy machine
@pytest.mark.timeout(300)
async def test_a_task_that_continues_as_new_2000_times_keeps_its_key_and_finishes(
    aclient: AsyncTaskClient, mongo_uri: str, db_name: str, mongo: MongoClient[dict[str, Any]]
) -> None:
    async with running_worker(registry, mongo_uri, db_name, concurrency=1):
        await aclient.publish("poller", "loop", {"n": 0, "until": LOOPS + 1})
        async with asyncio.timeout(110):
            task = await aclient.wait("loop")
    assert task.status.value == "succeeded", task.error
    assert task.key == "loop" and task.result["n"] == LOOPS + 1
    assert task.result["attempt"] == LOOPS + 1  # every run was the same task's
    assert task.params == {"n": LOOPS, "until": LOOPS + 1}  # the last journal's params
    assert [s.name for s in task.steps] == ["poll", "note"]  # its own journal only
    continued = task.continued
    assert continued is not None and continued.n == LOOPS
    assert [j.n for j in continued.journals] == list(
        range(LOOPS - MAX_JOURNALS_KEPT + 1, LOOPS + 1)
    )
    assert all(j.steps == 2 and j.last == "note" for j in continued.journals)
    states = [r.state for r in task.runs]
    assert states[-1] is RunState.SUCCESS and set(states[:-1]) == {RunState.CONTINUED}
    assert task.runs_folded == LOOPS + 1 - len(task.runs)
    raw = mongo[db_name]["tasks"].find_one({"_id": "loop"})
    assert raw is not None and len(bson.encode(raw)) < DOCUMENT_BOUND


@registry.task("inbox")
async def inbox(params: dict[str, Any], ctx: TaskContext) -> Any:
    got = await ctx.wait_for("msg")
    seen = [*params["seen"], got]
    if len(seen) < 3:
        ctx.continue_as_new({"seen": seen})
    return seen


async def test_the_signals_a_journal_took_go_with_it_and_the_others_stay(
    aclient: AsyncTaskClient, mongo_uri: str, db_name: str
) -> None:
    await aclient.publish("inbox", "in", {"seen": []})
    for n in range(3):  # all sent before the first run: each journal takes the next one
        await aclient.signal("in", "msg", n)
    await aclient.signal("in", "other", "kept")
    async with running_worker(registry, mongo_uri, db_name):
        async with asyncio.timeout(60):
            task = await aclient.wait("in")
    assert task.result == [0, 1, 2]
    assert [(s.name, s.payload) for s in task.signals] == [("msg", 2), ("other", "kept")]


@registry.task("leaf")
async def leaf(params: dict[str, Any], ctx: TaskContext) -> int:
    return int(params["n"]) * 10


@registry.task("rounds")
async def rounds(params: dict[str, Any], ctx: TaskContext) -> Any:
    got = await ctx.spawn_and_wait([Spawn("leaf", {"n": params["round"]})])
    done = [*params["done"], *got]
    if params["round"] < 2:
        ctx.continue_as_new({"round": params["round"] + 1, "done": done})
    return done


async def test_each_journals_children_are_its_own(
    aclient: AsyncTaskClient, mongo_uri: str, db_name: str
) -> None:
    async with running_worker(registry, mongo_uri, db_name, concurrency=1):
        await aclient.publish("rounds", "r", {"round": 0, "done": []})
        async with asyncio.timeout(60):
            task = await aclient.wait("r")
    assert task.result == [0, 10, 20]  # not the first journal's child again
    keys = [c["key"] for c in (await aclient.flow("r") or {})["children"]]
    assert sorted(keys) == ["r/spawn#1/0", "r/spawn#1@1/0", "r/spawn#1@2/0"]
    assert (task.steps[0].model_extra or {}).get("children") == "spawn#1@2"
    common = ("--uri", mongo_uri, "--database", db_name)
    code, out, _ = await asyncio.to_thread(run_cli, "get", "r", *common, width=200)
    assert code == 0 and "2 times as new" in out and "#2: 1 step, last spawn#1" in out, out
    with TestClient(create_app(mongo_uri, database=db_name, token="t")) as http:
        http.cookies.set(COOKIE, Keys.of("t").new_session())
        page = http.get("/ui/tasks/r").text
    assert 'id="continued"' in page and "#2 (1 step, last spawn#1)" in page


@registry.task("misuse")
async def misuse(params: dict[str, Any], ctx: TaskContext) -> Any:
    if params["how"] == "in a step":
        await ctx.step("s", lambda: ctx.continue_as_new({}))
    if params["how"] == "not a mapping":
        ctx.continue_as_new([1, 2])  # type: ignore[arg-type]
    ctx.continue_as_new({"big": "x" * 2_000_000})


async def test_misuse_fails_the_task_for_good_naming_the_problem(
    aclient: AsyncTaskClient, mongo_uri: str, db_name: str
) -> None:
    hows = {
        "in a step": "not in a step",
        "not a mapping": "a mapping",
        "too big": "over the",
    }
    async with running_worker(registry, mongo_uri, db_name):
        for how in hows:
            await aclient.publish("misuse", how.replace(" ", "-"), {"how": how})
        async with asyncio.timeout(60):
            for how, said in hows.items():
                task = await aclient.wait(how.replace(" ", "-"))
                assert task.status.value == "failed" and said in (task.error or ""), task.error
                assert task.continued is None
