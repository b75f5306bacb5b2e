"""What one task costs the server with a plain worker (issue 26): no limits, flows, schedules,
transactions, time limits, steps or tracing. mongod's profiler counts every operation the
worker sends while it runs tasks one at a time; the counts are pinned, so a change that adds
a round trip or an index key to every task fails here and has to say so."""

from __future__ import annotations

import collections
from typing import Any

from harness import running_worker, wait_for
from pymongo import MongoClient

from mtask import AsyncTaskClient
from mtask.registry import Registry

registry = Registry()
TASKS = 40


@registry.task("plain")
async def plain(params: dict[str, Any]) -> int:
    return 1


def _profiled(mongo: MongoClient[dict[str, Any]], db_name: str) -> list[dict[str, Any]]:
    db = mongo[db_name]
    db.command("profile", 0)
    return list(db["system.profile"].find({"appName": "mtask-worker-under-test"}))


async def test_a_plain_task_costs_one_claim_and_one_outcome(
    mongo_uri: str, db_name: str, aclient: AsyncTaskClient, mongo: MongoClient[dict[str, Any]]
) -> None:
    db = mongo[db_name]
    db.create_collection("system.profile", capped=True, size=64 * 2**20)
    uri = mongo_uri + ("&" if "?" in mongo_uri else "?") + "appname=mtask-worker-under-test"
    async with running_worker(registry, uri, db_name, heartbeat_interval=2.0) as (_, events):
        await aclient.publish("plain", "warm")
        await events.wait("recorded", key="warm")
        db.command("profile", 2)
        try:
            for i in range(TASKS):  # one at a time: each its own claim and outcome
                await aclient.publish("plain", f"t{i}")
                await events.wait("recorded", key=f"t{i}")
            await wait_for(lambda: events.matching("recorded", key=f"t{TASKS - 1}"))
        finally:
            entries = _profiled(mongo, db_name)
    on_tasks = collections.Counter(
        e["op"] + (":" + next(iter(e["command"])) if e["op"] == "command" else "")
        for e in entries
        if e["ns"] == f"{db_name}.tasks"
    )
    # the claim is one findAndModify, the outcome one update: nothing else reads or writes a
    # task (no ping: a run shorter than its ping interval is not pinged)
    assert on_tasks == {"command:findAndModify": TASKS, "update": TASKS}, on_tasks
    keys = sum(
        e.get("keysInserted", 0) + e.get("keysDeleted", 0)
        for e in entries
        if e["ns"] == f"{db_name}.tasks"
    )
    # claim + outcome, with every index a worker makes (store/schema.py; docs/performance.md,
    # "What a task costs"): the claim 4 (name_status_newest 2, claim 2), the outcome 5
    # (name_status_newest 2, claim 1, finished 1, expire 1)
    assert keys == 9 * TASKS, keys / TASKS
    # no collection of a feature this worker does not use is touched while it runs tasks
    touched = {e["ns"].split(".", 1)[1] for e in entries}
    unused = {"limits", "schedules", "flows", "throughput", "tasks.output", "tasks.steps"}
    unused |= {"triggers", "orders"}  # issue 63: no trigger, no wait on data: nothing read
    assert not touched & unused, touched


async def test_a_plain_task_carries_nothing_of_durable_workflows(
    mongo_uri: str, db_name: str, aclient: AsyncTaskClient, mongo: MongoClient[dict[str, Any]]
) -> None:
    """Issue 61: a handler that spawns nothing, gathers nothing and has no deadline writes no
    field of theirs and has no key in their index (``children_wait``); its claim's projection
    of ``spawn`` reads nothing (absent: no bytes)."""
    async with running_worker(registry, mongo_uri, db_name) as (_, events):
        await aclient.publish("plain", "lean")
        await events.wait("recorded", key="lean")
    doc = mongo[db_name]["tasks"].find_one({"_id": "lean"})
    assert doc is not None
    for field in ("spawned", "spawn", "steps", "waiting"):
        assert field not in doc, field
    assert "deadline" not in doc["options"]
    stats = mongo[db_name].command("collStats", "tasks", indexDetails=False)
    assert "children_wait" in stats["indexSizes"]
    keys = mongo[db_name]["tasks"].find({}, hint="children_wait").explain()
    assert keys["executionStats"]["totalKeysExamined"] == 0  # no task has a key in it
