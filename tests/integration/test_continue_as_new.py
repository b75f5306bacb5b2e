"""Loops without end (``ctx.continue_as_new``) on a real replica set with a real worker: a task
that continues as new 2,000 times keeps its key, its document stays small and it finishes; the
signals its journals took go with them and the others stay; each journal's children are its
own; bad params fail the task for good, naming the problem; a zombie's late continue is
refused by the run's fence."""

from __future__ import annotations

import asyncio
import datetime as dt
from typing import Any

import bson
import pytest
from fastapi.testclient import TestClient
from harness import run_cli, running_worker
from prometheus_client import REGISTRY
from pymongo import MongoClient

from mtask import AsyncTaskClient, TaskClient
from mtask.registry import Registry, TaskContext
from mtask.steps.children import Spawn
from mtask.store import Outcome, claim
from mtask.store import steps as store_steps
from mtask.store.outcomes import finish
from mtask.vocabulary import MAX_JOURNALS_KEPT, RunState
from mtask.web import create_app
from mtask.web.auth import COOKIE, Keys

registry = Registry()
LONG_AGO = dt.datetime(2001, 1, 1, tzinfo=dt.UTC)

LOOPS = 2000
DOCUMENT_BOUND = 16 * 1024
"""What the document of a task that continued as new 2,000 times (one step a journal) may
weigh: the journals it left are summarised (the newest ten), its runs folded (the newest 20)
(docs/steps.md, "Loops without end")."""


@registry.task("poller")
async def poller(params: dict[str, Any], ctx: TaskContext) -> Any:
    n = params["n"]
    seen = await ctx.step("poll", lambda: n + 1)  # one step a journal: 2,000 in all, over the cap
    if seen < params["until"]:
        ctx.continue_as_new({"n": seen, "until": params["until"]})
    return {"n": seen, "attempt": ctx.attempt}


@pytest.mark.slow  # 2,000 runs one after another: ~20 s quiet, minutes on a loaded machine
@pytest.mark.timeout(300)
async def test_a_task_that_continues_as_new_2000_times_keeps_its_key_and_finishes(
    aclient: AsyncTaskClient, mongo_uri: str, db_name: str, mongo: MongoClient[dict[str, Any]]
) -> None:
    async with running_worker(registry, mongo_uri, db_name, concurrency=1):
        await aclient.publish("poller", "loop", {"n": 0, "until": LOOPS + 1})
        async with asyncio.timeout(240):  # about 20 s on a quiet machine (3 writes a run)
            task = await aclient.wait("loop")
    assert task.status.value == "succeeded", task.error
    assert task.key == "loop" and task.result["n"] == LOOPS + 1
    assert task.result["attempt"] == LOOPS + 1  # every run was the same task's
    assert task.params == {"n": LOOPS, "until": LOOPS + 1}  # the last journal's params
    assert [s.name for s in task.steps] == ["poll"]  # its own journal only
    continued = task.continued
    assert continued is not None and continued.n == LOOPS
    assert [j.n for j in continued.journals] == list(
        range(LOOPS - MAX_JOURNALS_KEPT + 1, LOOPS + 1)
    )
    assert all(j.steps == 1 and j.last == "poll" for j in continued.journals)
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
    counted = REGISTRY.get_sample_value("mtask_runs_continued_total", {"name": "inbox"}) or 0
    async with running_worker(registry, mongo_uri, db_name):
        async with asyncio.timeout(60):
            task = await aclient.wait("in")
    assert task.result == [0, 1, 2]
    after = REGISTRY.get_sample_value("mtask_runs_continued_total", {"name": "inbox"})
    assert after == counted + 2  # the worker's metric counts the runs that continued
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
    aclient: AsyncTaskClient, mongo_uri: str, db_name: str, mongo: MongoClient[dict[str, Any]]
) -> None:
    async with running_worker(registry, mongo_uri, db_name, concurrency=1):
        await aclient.publish("rounds", "r", {"round": 0, "done": []})
        async with asyncio.timeout(60):
            task = await aclient.wait("r")
    assert task.result == [0, 10, 20]  # not the first journal's child again
    keys = sorted(c["key"] for c in (await aclient.flow("r") or {})["children"])
    assert len(set(keys)) == 3 and keys[0] == "r/spawn#1/0", keys  # each journal's its own
    assert all(k.startswith("r/spawn#1@") for k in keys[1:]), keys  # spawn#1@<run>
    raw = mongo[db_name]["tasks"].find_one({"_id": "r"})
    assert raw is not None and f"r/{raw['steps'][0]['tag']}/0" in keys[1:]  # the last journal's
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


def test_a_zombies_late_continue_is_refused_and_the_takeovers_lands(
    client: TaskClient, mongo: MongoClient[dict[str, Any]], db_name: str
) -> None:
    """The continue is one update fenced by the run: a frozen worker's, written after another
    took its task over, changes nothing; the rescuer's starts the task afresh."""
    db = mongo[db_name]
    client.publish("n", "k", {"gen": 0})
    [doc] = client._run(claim(["k"], ["n"], "w1", client.now()))
    zombie = str(doc["claim_run_id"])
    db.tasks.update_one(  # its lease ran out long ago: another worker takes the task over
        {"_id": "k"}, {"$set": {"runs.0.lease_expires_at": LONG_AGO, "next_claim_at": LONG_AGO}}
    )
    [doc] = client._run(claim(["k"], ["n"], "w2", client.now()))
    rescuer = str(doc["claim_run_id"])
    assert rescuer != zombie
    entry = {"name": "a", "kind": "call", "state": "done", "result": 1}
    client._run(store_steps.record("k", rescuer, 0, entry, None))

    def continued(run_id: str, gen: int) -> Outcome:
        return Outcome("k", run_id, RunState.CONTINUED, renew={"params": {"gen": gen}})

    assert client._run(finish(continued(zombie, 9), client.now())) is None  # fenced out
    before = db.tasks.find_one({"_id": "k"})
    assert before["params"] == {"gen": 0} and "continued" not in before
    assert [s["name"] for s in before["steps"]] == ["a"]
    after = client._run(finish(continued(rescuer, 1), client.now()))
    assert after is not None and after["params"] == {"gen": 1} and "steps" not in after
    assert after["status"] == "pending" and after["continued"]["n"] == 1
    [journal] = after["continued"]["journals"]
    assert journal["run_id"] == rescuer and journal["steps"] == 1 and journal["last"] == "a"
    assert [r["state"] for r in after["runs"]][-1] == "CONTINUED"
    # the zombie's second try, after the continue: still nothing
    assert client._run(finish(continued(zombie, 9), client.now())) is None
    assert db.tasks.find_one({"_id": "k"})["params"] == {"gen": 1}
