"""A parent run again runs its children again, on a real replica set with a real (in-process)
worker: a retry of a parent failed by ``ChildFailed`` (plain, or from its spawn step) spawns a
new generation of children, whose results it gets; a parent reset by ``on_conflict="reset"``
gets its new children's results, not the old ones'; a key another task already holds fails the
spawn with an error naming it, instead of a parent waiting for ever. Side effects are counted
in a side collection (``effects``), by the handlers themselves."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from harness import running_worker
from pymongo import MongoClient
from workflowapp import EFFECTS, effect

from mtask import AsyncTaskClient
from mtask.registry import Registry, TaskContext
from mtask.steps.children import Spawn

registry = Registry()


@pytest.fixture(autouse=True)
def _effects(mongo_uri: str, db_name: str) -> None:
    EFFECTS.update(uri=mongo_uri, db=db_name)


def counted(**match: Any) -> int:
    client: MongoClient[dict[str, Any]] = MongoClient(EFFECTS["uri"])
    try:
        return client[EFFECTS["db"]]["effects"].count_documents(match)
    finally:
        client.close()


@registry.task("gated")
async def gated(params: dict[str, Any], ctx: TaskContext) -> int:
    """Its square; a gated one fails until the test opens the gate."""
    effect(ctx.key, "gated")
    if params.get("gate") and not counted(what="open"):
        raise ValueError("the gate is shut")
    return int(params["n"]) ** 2


@registry.task("strict")
async def strict(params: dict[str, Any], ctx: TaskContext) -> Any:
    """Three children, the second gated; a ``ChildFailed`` fails the parent."""
    kids = [Spawn("gated", {"n": n, "gate": n == 1}, options={"max_retries": 0}) for n in range(3)]
    return await ctx.spawn_and_wait(kids, name="kids")


@registry.task("stamp")
async def stamp(params: dict[str, Any], ctx: TaskContext) -> int:
    """How many times a child of this place ran, this one included."""
    effect(f"stamp{params['n']}", "stamp")
    return counted(key=f"stamp{params['n']}")


@registry.task("stamper")
async def stamper(params: dict[str, Any], ctx: TaskContext) -> Any:
    return await ctx.spawn_and_wait([Spawn("stamp", {"n": n}) for n in range(2)])


@pytest.mark.parametrize("how", ["retry", "from step"])
async def test_a_retried_parent_spawns_its_children_again(
    aclient: AsyncTaskClient, mongo_uri: str, db_name: str, how: str
) -> None:
    async with running_worker(
        registry, mongo_uri, db_name, concurrency=2, flow_sweep_interval=0.2
    ) as (_, events):
        await aclient.publish("strict", "p1", {}, options={"max_retries": 0})
        async with asyncio.timeout(60):
            failed = await aclient.wait("p1")
        assert failed.status.value == "failed"
        assert "'p1/kids/1' (gated) failed: ValueError: the gate is shut" in (failed.error or "")
        effect("test", "open")
        if how == "retry":
            again = await aclient.retry("p1")
        else:
            again = await aclient.retry("p1", from_step="kids")
        # open again; ``retry(from_step=...)`` reads the task back after its update, by when
        # the running worker may have claimed it (and, once it runs, journaled a new spawn)
        assert again.status.value in ("pending", "running")
        if how == "retry":  # the retry's own update's document: nothing ran since
            assert again.status.value == "pending" and again.steps == []
        await events.wait("recorded", key="p1", state="WAITING", count=2)
        async with asyncio.timeout(60):
            task = await aclient.wait("p1")
    assert task.status.value == "succeeded", task.error
    assert task.result == [0, 1, 4]
    assert counted(what="gated") == 6  # a new generation of three: every child ran again
    spawn = task.steps[0]
    assert (spawn.name, spawn.state, spawn.total) == ("kids", "done", 3)
    assert task.spawned is not None and task.spawned.step.startswith("kids@")
    assert (task.spawned.done, task.spawned.failed) == (3, 0)
    kids, total = await aclient.children("p1")
    assert total == 6  # the first generation stays, as it ended
    first = {k.key: k.status.value for k in kids if k.key.startswith("p1/kids/")}
    assert first == {"p1/kids/0": "succeeded", "p1/kids/1": "failed", "p1/kids/2": "succeeded"}
    new = [k for k in kids if k.key.startswith(f"p1/{task.spawned.step}/")]
    assert [k.status.value for k in new] == ["succeeded"] * 3


async def test_a_reset_parent_does_not_reuse_its_old_childrens_results(
    aclient: AsyncTaskClient, mongo_uri: str, db_name: str
) -> None:
    async with running_worker(registry, mongo_uri, db_name, concurrency=2) as (_, events):
        await aclient.publish("stamper", "s1", {})
        async with asyncio.timeout(60):
            first = await aclient.wait("s1")
        assert first.result == [1, 1]
        published = await aclient.publish("stamper", "s1", {}, on_conflict="reset")
        assert published.updated
        await events.wait("recorded", key="s1", state="SUCCESS", count=2)
        task = await aclient.get("s1")
    assert task is not None and task.result == [2, 2]  # each child ran again
    assert counted(what="stamp") == 4


async def test_a_key_another_task_holds_fails_the_spawn_naming_it(
    aclient: AsyncTaskClient, mongo_uri: str, db_name: str
) -> None:
    await aclient.publish("gated", "c1/kids/1", {"n": 7})  # not a child of c1: its own
    async with running_worker(registry, mongo_uri, db_name, concurrency=2) as (_, events):
        await aclient.publish("strict", "c1", {}, options={"max_retries": 0})
        ended = await events.wait("recorded", key="c1")
        assert ended["state"] == "FAIL", ended  # not WAITING for a child that is not its
        task = await aclient.get("c1")
    assert task is not None and task.status.value == "failed" and task.failed_permanently
    said = task.error or ""
    assert "'c1/kids/1'" in said and "'gated' published on its own" in said, said
    assert "not a child of 'c1'" in said
