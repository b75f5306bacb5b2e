"""What one task costs the server with a plain worker: no limits, flows, schedules,
transactions, time limits, steps or tracing. mongod's profiler counts every operation the
worker sends while it runs tasks one at a time; the counts are pinned, so a change that adds
a round trip or an index key to every task fails here and has to say so. Issue 62: a plain
name pays the same beside names that use flow control (limits, shared resources, units, group
overrides and weights, lossy limits, batch handlers, supersede, debounce, BackOff, Snooze, a
schedule's overlap), in the same worker's registry, all of them configured and used."""

from __future__ import annotations

import collections
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple

from harness import running_worker, wait_for
from pymongo import MongoClient

from mtask import AsyncTaskClient, BackOff, BatchItem, Snooze
from mtask.registry import Registry, TaskContext
from mtask.worker import Worker
from mtask.worker.claiming.ahead import AdaptiveAhead

TASKS = 40
OPEN = ("pending", "running")
QUIET = {"limits_refresh": 600.0, "flow_sweep_interval": 600.0, "sweep_interval": 600.0}
"""The worker's periodic reads (every limit, the flow sweep, the relay's rescan) kept out of
the few seconds measured: they cost by the interval, not by the task (docs/performance.md)."""
UNUSED = {"limits", "schedules", "flows", "throughput", "tasks.output", "tasks.steps"}
UNUSED |= {"triggers", "orders"}  # no trigger, no wait on data: nothing read
Mongo = MongoClient[dict[str, Any]]


def _plain_registry() -> Registry:
    registry = Registry()

    @registry.task("plain")
    async def plain(params: dict[str, Any]) -> int:
        return 1

    return registry


registry = _plain_registry()


def _beside_registry() -> Registry:
    """``plain`` beside a name of each flow-control feature."""
    beside = _plain_registry()

    @beside.task("metered", uses=["api"], units=3)  # a shared resource, cost units
    async def metered(params: dict[str, Any]) -> int:
        return 1

    @beside.task("tiered")  # a group limit, one group's override and weight
    async def tiered(params: dict[str, Any]) -> int:
        return 1

    @beside.task("lossy")  # a lossy limit
    async def lossy(params: dict[str, Any]) -> int:
        return 1

    @beside.task("batched", batch=10, batch_timeout=0.05)
    async def batched(items: list[BatchItem]) -> list[int]:
        return [1] * len(items)

    @beside.task("polite")  # BackOff and Snooze, each once
    async def polite(params: dict[str, Any], ctx: TaskContext) -> int:
        if ctx.attempt == 1 and params.get("back_off"):
            raise BackOff(0.2, name=True)
        if ctx.attempt == 1 and params.get("snooze"):
            raise Snooze(0.2)
        return ctx.attempt

    @beside.task("latest")  # published with supersede, and with debounce
    async def latest(params: dict[str, Any]) -> int:
        return 1

    beside.schedule("latest", cron="0 0 1 1 *", overlap="skip")  # a schedule's overlap
    return beside


class Costs(NamedTuple):
    """What the worker sent while it ran the plain tasks, by mongod's profiler."""

    on_tasks: collections.Counter[str]
    """The operations on ``tasks``, by kind."""
    keys: int
    """Index keys inserted and deleted in ``tasks``."""
    touched: set[str]
    """The collections the worker read or wrote."""


async def _plain_tasks_cost(
    mongo: Mongo,
    mongo_uri: str,
    db_name: str,
    aclient: AsyncTaskClient,
    registry: Registry,
    app: str,
    first: Callable[[Worker, Any], Awaitable[None]] | None = None,
) -> Costs:
    """Run ``TASKS`` plain tasks one at a time, each its own claim and outcome, on a worker of
    ``registry`` (after ``first``, given the worker and its events), under the profiler."""
    db = mongo[db_name]
    if "system.profile" not in db.list_collection_names():
        db.create_collection("system.profile", capped=True, size=64 * 2**20)
    uri = mongo_uri + ("&" if "?" in mongo_uri else "?") + f"appname={app}"
    async with running_worker(registry, uri, db_name, heartbeat_interval=2.0, **QUIET) as (
        worker,
        events,
    ):
        if first is not None:
            await first(worker, events)
        await aclient.publish("plain", f"{app}-warm")
        await events.wait("recorded", key=f"{app}-warm")
        gate = worker.parts.gate  # its read once the worker's events began is done
        await wait_for(lambda: not gate.before_ready and gate.read_all_at > 0)
        db.command("profile", 2)
        try:
            for i in range(TASKS):
                await aclient.publish("plain", f"{app}-{i}")
                await events.wait("recorded", key=f"{app}-{i}")
        finally:
            db.command("profile", 0)
            entries = list(db["system.profile"].find({"appName": app}))
    on_tasks = [e for e in entries if e["ns"] == f"{db_name}.tasks"]
    return Costs(
        collections.Counter(
            e["op"] + (":" + next(iter(e["command"])) if e["op"] == "command" else "")
            for e in on_tasks
        ),
        sum(e.get("keysInserted", 0) + e.get("keysDeleted", 0) for e in on_tasks),
        {e["ns"].split(".", 1)[1] for e in entries},
    )


async def test_a_plain_task_costs_one_claim_and_one_outcome(
    mongo_uri: str, db_name: str, aclient: AsyncTaskClient, mongo: Mongo
) -> None:
    cost = await _plain_tasks_cost(mongo, mongo_uri, db_name, aclient, registry, "mtask-plain")
    # the claim is one findAndModify, the outcome one update: nothing else reads or writes a
    # task (no ping: a run shorter than its ping interval is not pinged)
    assert cost.on_tasks == {"command:findAndModify": TASKS, "update": TASKS}, cost.on_tasks
    # claim + outcome, with every index a worker makes (store/schema.py; docs/performance.md,
    # "What a task costs"): the claim 4 (name_status_newest 2, claim 2), the outcome 5
    # (name_status_newest 2, claim 1, finished 1, expire 1)
    assert cost.keys == 9 * TASKS, cost.keys / TASKS
    # no collection of a feature this worker does not use is touched while it runs tasks
    assert not cost.touched & UNUSED, cost.touched


async def _use_flow_control(aclient: AsyncTaskClient) -> None:
    """Every issue-62 feature configured, before the worker starts."""
    await aclient.set_limit(resource="api", concurrency=5, rate=100.0)
    await aclient.set_limit("metered", concurrency=6)
    await aclient.set_limit("tiered", group_concurrency=2)
    await aclient.set_group_limit("tiered", "gold", concurrency=4, weight=3)
    await aclient.set_limit("lossy", concurrency=1, overflow="drop")
    await aclient.set_limit("polite", concurrency=3)


async def _run_flow_control(
    aclient: AsyncTaskClient, mongo: Mongo, db_name: str, worker: Worker, events: Any
) -> None:
    """A task of each feature's name run to its end (a debounce window left open), and the
    worker seen to hold them as configured."""
    gate = worker.parts.gate
    assert {"metered", "tiered", "lossy", "polite"} <= gate.restricting, gate.restricting
    assert "plain" not in gate.restricting
    # The one thing a plain name does pay beside them, and not in a trickle's counts: while
    # any name of the worker is under a limit (here a resource it uses, too), ``--prefetch
    # auto`` claims nothing ahead, for every name (claiming/ahead.py: a limited run claimed
    # ahead would hold its slot while it waits), so a plain name's drain claims at most
    # ``concurrency`` keys a round trip instead of twice that (docs/performance.md).
    ahead = worker.parts.claimer.ahead
    assert isinstance(ahead, AdaptiveAhead) and ahead.limited() and not ahead.allowed()
    await aclient.publish("metered", "m1")
    await aclient.publish("tiered", "g1", options={"group": "gold"})
    await aclient.publish("tiered", "s1", options={"group": "silver"})
    await aclient.publish("lossy", "x1")
    for i in range(3):
        await aclient.publish("batched", f"b{i}")
    await aclient.publish("polite", "bo", {"back_off": True})
    await aclient.publish("polite", "sn", {"snooze": True})
    await aclient.publish("latest", "l1", supersede="cancel_queued")
    await aclient.publish("latest", "l2", supersede="cancel_queued")
    await aclient.publish("latest", "d", debounce=600)  # its window stays open, not due
    # bo: released by its BackOff first; sn: snoozed first
    for key in ("m1", "g1", "s1", "x1", "b0", "b1", "b2", "l2", "bo", "sn"):
        await events.wait("recorded", key=key, state="SUCCESS")
    db = mongo[db_name]
    # nothing left running, no slot held, no release on its way: the debounce window alone open
    await wait_for(lambda: db.tasks.count_documents({"status": {"$in": list(OPEN)}}) == 1)
    await wait_for(lambda: not db.limits.count_documents({"holders.0": {"$exists": True}}))
    assert db.limits.find_one({"_id": "polite", "held_until": {"$exists": True}})  # BackOff's
    assert db.tasks.find_one({"_id": "sn"}, {"snoozes": 1})["snoozes"] == 1
    assert db.tasks.find_one({"_id": "l1"}, {"superseded_by": 1}).get("superseded_by") in (
        None,
        "l2",
    )  # cancelled by l2, unless it was running by then


async def test_a_plain_name_pays_nothing_for_flow_control_beside_it(
    mongo_uri: str, db_name: str, aclient: AsyncTaskClient, mongo: Mongo
) -> None:
    """The same plain tasks cost the same beside every flow-control feature as alone:
    the same operations on ``tasks``, the same index keys, and no read or write of ``limits``
    (nor of any other feature's collection) for them."""
    alone = await _plain_tasks_cost(mongo, mongo_uri, db_name, aclient, registry, "mtask-alone")
    await _use_flow_control(aclient)

    async def first(worker: Worker, events: Any) -> None:
        await _run_flow_control(aclient, mongo, db_name, worker, events)

    beside = await _plain_tasks_cost(
        mongo, mongo_uri, db_name, aclient, _beside_registry(), "mtask-beside", first
    )
    assert alone.on_tasks == {"command:findAndModify": TASKS, "update": TASKS}, alone
    assert beside.on_tasks == alone.on_tasks, (beside, alone)
    assert beside.keys == alone.keys == 9 * TASKS, (beside.keys / TASKS, alone.keys / TASKS)
    assert not beside.touched & UNUSED, beside.touched
    # beside the tasks: the heartbeats and the relay's lease renewals, each on its own clock
    # (one may fall in one window and not the other), none of them the plain tasks'
    periodic = {"workers", "relays"}
    assert beside.touched <= alone.touched | periodic, (beside.touched, alone.touched)


async def test_a_plain_task_carries_nothing_of_durable_workflows(
    mongo_uri: str, db_name: str, aclient: AsyncTaskClient, mongo: Mongo
) -> None:
    """A handler that spawns nothing, gathers nothing and has no deadline writes no
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
    for index in ("children_wait", "cancel_children"):
        assert index in stats["indexSizes"]
        keys = mongo[db_name]["tasks"].find({}, hint=index).explain()
        assert keys["executionStats"]["totalKeysExamined"] == 0  # no task has a key in it


async def test_a_limit_on_a_name_this_worker_does_not_run_leaves_its_claim_ahead_on(
    mongo_uri: str, db_name: str, aclient: AsyncTaskClient
) -> None:
    """``--prefetch auto`` stops claiming ahead while a name the worker runs is limited (a run
    claimed ahead would hold the limit's slot while it waits); a limit on a name it does not
    run, or a resource none of its names uses, stops nothing here (it stopped every worker of
    the cluster)."""
    async with running_worker(registry, mongo_uri, db_name) as (worker, _):
        ahead = worker.parts.claimer.ahead
        gate = worker.parts.gate
        assert isinstance(ahead, AdaptiveAhead)
        await aclient.set_limit("elsewhere", concurrency=1)
        await aclient.set_limit(resource="api", concurrency=1, names=["elsewhere"])
        await wait_for(lambda: "elsewhere" in gate.restricting, 10)
        assert not ahead.limited()
        await aclient.set_limit("plain", concurrency=100)
        await wait_for(lambda: "plain" in gate.restricting, 10)
        assert ahead.limited() and not ahead.allowed()
