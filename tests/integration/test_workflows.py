"""Issue 61's durable workflows on a real replica set with a real (in-process) worker: children
spawned and awaited without a slot (a worker of concurrency 1 runs the parent and every child),
a failing child raising in its parent, a cancelled parent cancelling its children, a lost
wake-up found by the sweep; parallel steps; a loop's numbered steps; a step's own retries; a
whole-task deadline; a run again from a step; a step renamed and dropped; output said inside a
step recorded once; ``now``/``uuid`` decided once. Side effects are counted in a side
collection (``effects``), by the handlers themselves."""

from __future__ import annotations

import asyncio
import datetime as dt
from typing import Any

import pytest
from harness import running_worker, wait_for
from pymongo import MongoClient
from workflowapp import EFFECTS, effect

from mtask import AsyncTaskClient
from mtask.errors import InvalidTask, InvalidTransition
from mtask.registry import Registry, TaskContext
from mtask.steps.children import ChildFailed, Spawn
from mtask.steps.policy import StepPolicy
from mtask.store import bulk
from mtask.store import children as store_children
from mtask.worker.maintenance import flow_sweep

registry = Registry()
URI: dict[str, str] = {}
"""What a handler counts across its runs (``tries:key``)."""


@pytest.fixture(autouse=True)
def _effects(mongo_uri: str, db_name: str) -> None:
    """The handlers count their side effects (``workflowapp.effect``) in the test's database."""
    EFFECTS.update(uri=mongo_uri, db=db_name)


def effects(mongo: MongoClient[dict[str, Any]], db_name: str, **match: Any) -> int:
    return mongo[db_name]["effects"].count_documents(match)


@registry.task("square", options={"retry_delay_ms": 0})
async def square(params: dict[str, Any], ctx: TaskContext) -> int:
    effect(ctx.key, "square")
    if params.get("fail"):
        raise ValueError(f"cannot square {params['n']}")
    if params.get("hold"):
        await ctx.wait_for("never")
    return int(params["n"]) ** 2


@registry.task("fanout")
async def fanout(params: dict[str, Any], ctx: TaskContext) -> Any:
    effect(ctx.key, "fanout-run")
    kids = [
        Spawn(
            "square",
            {"n": n, "fail": n in params.get("fail", []), "hold": params.get("hold")},
            options={"max_retries": 0},
        )
        for n in range(params["n"])
    ]
    try:
        results = await ctx.spawn_and_wait(kids, name="squares")
    except ChildFailed as exc:
        return {"failed": exc.failed, "said": str(exc), "results": exc.results}
    return {"sum": sum(results), "results": results}


@registry.task("quick")
async def quick(params: dict[str, Any], ctx: TaskContext) -> str:
    return "quick"


async def test_children_run_while_their_parent_waits_without_a_slot(
    aclient: AsyncTaskClient, mongo_uri: str, db_name: str, mongo: MongoClient[dict[str, Any]]
) -> None:
    async with running_worker(registry, mongo_uri, db_name, concurrency=1) as (_, events):
        await aclient.publish("fanout", "f1", {"n": 20})
        async with asyncio.timeout(60):
            task = await aclient.wait("f1")
    assert task.result == {
        "sum": sum(n * n for n in range(20)),
        "results": [n * n for n in range(20)],
    }
    assert [r.state.value for r in task.runs] == ["WAITING", "SUCCESS"]
    assert effects(mongo, db_name, what="square") == 20  # each child ran once
    assert effects(mongo, db_name, what="fanout-run") == 2
    spawn = task.steps[0]
    assert (spawn.kind, spawn.state, spawn.total) == ("children", "done", 20)
    assert task.spawned is not None and (task.spawned.done, task.spawned.total) == (20, 20)
    child = await aclient.get("f1/squares/7")
    assert child is not None and child.parent == "f1" and child.spawn is not None
    assert (child.spawn.parent, child.spawn.step, child.spawn.index) == ("f1", "squares", 7)
    tree = await aclient.flow("f1")
    assert tree is not None and len(tree["children"]) == 20
    # a parent waits in run state WAITING: the one slot ran all 20 children meanwhile
    claimed = [e["key"] for e in events.matching("claimed")]
    assert claimed[0] == "f1" and claimed[-1] == "f1" and len(claimed) == 22


async def test_a_failing_child_raises_in_its_parent(
    aclient: AsyncTaskClient, mongo_uri: str, db_name: str
) -> None:
    async with running_worker(registry, mongo_uri, db_name, concurrency=2):
        await aclient.publish("fanout", "f2", {"n": 4, "fail": [2]})
        async with asyncio.timeout(60):
            task = await aclient.wait("f2")
    assert task.status.value == "succeeded", task.error
    assert task.result["failed"] == 1 and task.result["results"] == [0, 1, None, 9]
    assert "'f2/squares/2' (square) failed: ValueError: cannot square 2" in task.result["said"]
    spawn = task.steps[0]
    assert spawn.state == "failed" and spawn.failed == 1
    assert spawn.failures[0]["key"] == "f2/squares/2"


@pytest.mark.parametrize("how", ["one", "by filter"])
async def test_cancelling_a_parent_cancels_its_open_children(
    aclient: AsyncTaskClient, worker_after: Any, how: str
) -> None:
    """One task's cancel, or a cancel by filter (the dashboard's bulk action, ``POST
    /tasks:cancel``, ``mtask cancel --name``): no child is left open for nobody."""
    async with worker_after(
        registry, aclient.publish("fanout", "f3", {"n": 3, "hold": True}), "f3",
        state="WAITING", concurrency=4,
    ) as (_, events):  # fmt: skip
        for n in range(3):
            await events.wait("recorded", key=f"f3/squares/{n}", state="WAITING")
        if how == "one":
            cancelled = await aclient.cancel("f3")
            assert cancelled.status.value == "cancelled"
        else:
            done = await aclient.bulk("cancel", bulk.Filter(name="fanout"))
            assert (done.matched, done.changed) == (1, 1)
        kids = [await aclient.get(f"f3/squares/{n}") for n in range(3)]
    assert [k.status.value for k in kids if k is not None] == ["cancelled"] * 3


async def test_a_lost_count_is_found_by_the_sweep(
    aclient: AsyncTaskClient,
    mongo_uri: str,
    db_name: str,
    mongo: MongoClient[dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The worker that recorded the children's outcomes died before counting them: their
    parent's count stays short. The sweep counts the children itself and wakes it.

    The sweep counts a waiting parent at most once a minute (``CHILDREN_RECHECK_S``): one that
    came while a child still ran (its handler slowed by a loaded machine) would leave the parent
    for a minute, past this test's wait; here each sweep counts again."""
    monkeypatch.setattr(flow_sweep, "CHILDREN_RECHECK_S", 0.0)
    original = store_children.count_finished

    def lost(keys: Any) -> Any:  # the count never reaches MongoDB
        return original([])

    store_children.count_finished = lost  # type: ignore[assignment]
    try:
        async with running_worker(
            registry, mongo_uri, db_name, concurrency=2, flow_sweep_interval=0.2
        ) as (_, events):
            await aclient.publish("fanout", "f4", {"n": 3})
            await events.wait("recorded", key="f4", state="WAITING")
            for n in range(3):
                await events.wait("recorded", key=f"f4/squares/{n}", state="SUCCESS")
            doc = mongo[db_name]["tasks"].find_one({"_id": "f4"})
            assert doc is not None and doc["spawned"]["done"] == 0  # no count came
            async with asyncio.timeout(30):
                task = await aclient.wait("f4")
    finally:
        store_children.count_finished = original  # type: ignore[assignment]
    assert task.result["sum"] == 5


# -- parallel steps, loops, policies --------------------------------------------------------------


@registry.task("parallel")
async def parallel(params: dict[str, Any], ctx: TaskContext) -> Any:
    async def fetch(n: int) -> int:
        effect(ctx.key, f"fetch-{n}")
        await asyncio.sleep(0.01 * (3 - n))
        return n * 10

    got = await ctx.gather(*(ctx.step("fetch", fetch, n) for n in range(3)))
    total = 0
    for n in got:  # a loop of steps: numbered
        total += await ctx.step("add", lambda n=n: n)
    return {"got": got, "total": total}


@registry.task("flaky", options={"max_retries": 0})
async def flaky(params: dict[str, Any], ctx: TaskContext) -> str:
    def call() -> str:
        effect(ctx.key, "try")
        tries = URI.setdefault(f"tries:{ctx.key}", "0")
        URI[f"tries:{ctx.key}"] = str(int(tries) + 1)
        if int(tries) < 2:
            raise ConnectionError("upstream reset")
        return "finally"

    return str(await ctx.step("call", call, policy=StepPolicy(retries=3, backoff=0.01)))


async def test_parallel_steps_loops_and_a_policy_spent_in_place(
    aclient: AsyncTaskClient, mongo_uri: str, db_name: str, mongo: MongoClient[dict[str, Any]]
) -> None:
    async with running_worker(registry, mongo_uri, db_name):
        await aclient.publish("parallel", "p1", {})
        await aclient.publish("flaky", "fl1", {})
        async with asyncio.timeout(30):
            task = await aclient.wait("p1")
            flaky_task = await aclient.wait("fl1")
    assert task.result == {"got": [0, 10, 20], "total": 30}
    names = [s.name for s in task.steps]
    assert sorted(names[:3]) == ["fetch", "fetch#2", "fetch#3"]
    assert names[3:] == ["add", "add#2", "add#3"]
    assert {s.group for s in task.steps[:3]} == {"gather#1"} and task.steps[3].group is None
    assert flaky_task.status.value == "succeeded" and flaky_task.result == "finally"
    assert [r.state.value for r in flaky_task.runs] == ["SUCCESS"]  # no retry of the task
    assert flaky_task.steps[0].attempts == 3 and effects(mongo, db_name, key="fl1") == 3


# -- a deadline, run again from a step, remarks, output, values -----------------------------------


@registry.task("sleeper", options={"retry_delay_ms": 3_600_000})
async def sleeper(params: dict[str, Any], ctx: TaskContext) -> str:
    await ctx.step("before", effect, ctx.key, "before")
    await ctx.sleep(params.get("sleep", 3600))
    if params.get("fail"):
        raise RuntimeError("fails after the sleep")
    return "awake"


async def test_a_deadline_fails_a_sleeping_task_with_its_reason(
    aclient: AsyncTaskClient, mongo_uri: str, db_name: str
) -> None:
    async with running_worker(registry, mongo_uri, db_name) as (_, events):
        deadline = await aclient.now() + dt.timedelta(seconds=1)
        await aclient.publish("sleeper", "d1", {}, options={"deadline": deadline})
        await events.wait("recorded", key="d1", state="WAITING")
        waiting = await aclient.get("d1")
        assert waiting is not None and waiting.next_claim_at is not None
        assert waiting.next_claim_at <= deadline.replace(
            microsecond=deadline.microsecond // 1000 * 1000
        )
        async with asyncio.timeout(30):
            task = await aclient.wait("d1")
    assert task.status.value == "failed" and task.failed_permanently
    assert "deadline passed" in (task.error or "")
    assert task.options.deadline is not None


async def test_run_again_from_a_step_keeps_the_steps_before_it(
    aclient: AsyncTaskClient, mongo_uri: str, db_name: str, mongo: MongoClient[dict[str, Any]]
) -> None:
    async with running_worker(registry, mongo_uri, db_name) as (_, events):
        await aclient.publish(
            "sleeper", "r1", {"sleep": 0, "fail": True}, options={"max_retries": 0}
        )
        async with asyncio.timeout(30):
            failed = await aclient.wait("r1")
        assert failed.status.value == "failed"
        with pytest.raises(InvalidTask, match="no step 'nope'"):
            await aclient.retry("r1", from_step="nope")
        again = await aclient.retry("r1", from_step="sleep#1")
        # read back after its update: the running worker may have claimed it (and, once it
        # runs, journaled its sleep) by then; the kept step is there either way
        assert again.status.value in ("pending", "running")
        assert [s.name for s in again.steps][:1] == ["before"]
        await events.wait("recorded", key="r1", state="FAIL", count=2)
    assert effects(mongo, db_name, key="r1", what="before") == 1  # kept, replayed


async def test_a_parked_journal_is_renamed_and_dropped_fenced(
    aclient: AsyncTaskClient, worker_after: Any
) -> None:
    async with worker_after(
        registry, aclient.publish("sleeper", "m1", {}), "m1", state="WAITING"
    ) as (_, events):
        renamed = await aclient.rename_step("m1", "before", "prepare")
        assert (renamed.index, renamed.to) == (0, "prepare")
        with pytest.raises(InvalidTransition, match="cannot be changed"):
            await aclient.rename_step("m1", "prepare", "sleep#1")  # a name another step has
        task = await aclient.get("m1")
        assert task is not None and [s.name for s in task.steps] == ["prepare", "sleep#1"]
        dropped = await aclient.drop_step("m1", "prepare")
        assert dropped.index == 0 and not dropped.woke
        task = await aclient.get("m1")
        assert task is not None and [s.name for s in task.steps] == ["sleep#1"]
        assert task.waiting is not None and task.waiting.index == 0  # moved up with its step
        dropped = await aclient.drop_step("m1", "sleep#1")
        assert dropped.woke  # it waited there: it runs now
        await events.wait("recorded", key="m1", state="WAITING", count=2)  # replays, sleeps
    with pytest.raises(InvalidTask, match="no step"):
        await aclient.drop_step("m1", "ghost")


@registry.task("talker")
async def talker(params: dict[str, Any], ctx: TaskContext) -> Any:
    def say() -> int:
        ctx.log.info("inside the step")
        ctx.emit("chunk")
        return 1

    first = ctx.now()
    ident = ctx.uuid()
    await ctx.step("say", say)
    await ctx.sleep(0.05)
    return {"now": first.isoformat(), "uuid": str(ident)}


async def test_output_inside_a_step_and_values_are_recorded_once(
    aclient: AsyncTaskClient, mongo_uri: str, db_name: str
) -> None:
    async with running_worker(registry, mongo_uri, db_name):
        await aclient.publish("talker", "t1", {})
        async with asyncio.timeout(30):
            task = await aclient.wait("t1")
        lines = await aclient.output("t1")
    assert [r.state.value for r in task.runs] == ["WAITING", "SUCCESS"]
    said = [e for e in lines if e.kind == "log" and e.message == "inside the step"]
    chunks = [e for e in lines if e.kind == "chunk"]
    assert len(said) == 1 and len(chunks) == 1  # said once, not again by the replay
    values = {s.name: s.result for s in task.steps if s.kind == "value"}
    assert set(values) == {"now#1", "uuid#1"}
    assert task.result["uuid"] == values["uuid#1"]
    assert task.result["now"] == values["now#1"].isoformat()


async def test_a_parent_that_waits_frees_its_slot_for_others(
    aclient: AsyncTaskClient, worker_after: Any
) -> None:
    async with worker_after(
        registry, aclient.publish("fanout", "f5", {"n": 1, "hold": True}), "f5",
        state="WAITING", concurrency=1,
    ) as (_, events):  # fmt: skip
        await aclient.publish("quick", "q5", {})
        async with asyncio.timeout(30):
            assert (await aclient.wait("q5")).result == "quick"
        await wait_for(lambda: events.matching("recorded", key="f5/squares/0", state="WAITING"))
        parent = await aclient.get("f5")
    assert parent is not None and parent.waiting is not None
    assert parent.waiting.children == "squares"


async def test_a_process_isolated_handler_gathers_loops_and_spawns(
    aclient: AsyncTaskClient, mongo_uri: str, db_name: str
) -> None:
    import os

    import workflowapp

    async with running_worker(workflowapp.in_child, mongo_uri, db_name, concurrency=1):
        await aclient.publish("child_workflow", "c1", {})
        async with asyncio.timeout(60):
            task = await aclient.wait("c1")
    assert task.status.value == "succeeded", task.error
    result = task.result
    assert (result["a"], result["b"], result["looped"], result["kids"]) == (1, 2, [0, 1], [6, 8])
    assert result["pid"] != os.getpid()  # it ran in a child process
    names = [s.name for s in task.steps]
    assert sorted(names[:2]) == ["a", "b"] and names[2:] == ["now#1", "loop", "loop#2", "spawn#1"]
    assert [r.state.value for r in task.runs] == ["WAITING", "SUCCESS"]
