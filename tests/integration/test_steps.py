"""Durable steps end to end on a real replica set with a real (in-process) worker: a step runs
once per task and replays across retries; a failed step is recorded and retried; sleeps free
the slot and resume on the server's clock; signals sent before, after and never; large
results spill aside and come back; the replay rules; a transactional step's writes commit with
its record; plain-def handlers on threads (docs/steps.md)."""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import json
from collections import Counter
from typing import Any

import pytest
from harness import running_worker, wait_for
from pymongo import AsyncMongoClient

from mtask import AsyncTaskClient
from mtask.errors import InvalidTask, InvalidTransition, TaskNotFound
from mtask.follow.events import TaskEvent
from mtask.follow.events import events as events_of
from mtask.registry import Registry, TaskContext
from mtask.steps import SignalTimeout
from mtask.store import steps as store_steps

registry = Registry()
CALLS: Counter[str] = Counter()
FAIL_ONCE: set[str] = set()


def _call(label: str, value: Any) -> Any:
    CALLS[label] += 1
    if label in FAIL_ONCE:
        FAIL_ONCE.discard(label)
        raise RuntimeError(f"{label} failed once")
    return value


@registry.task("checkout", options={"retry_delay_ms": 0, "max_retries": 3})
async def checkout(params: dict[str, Any], ctx: TaskContext) -> dict[str, Any]:
    k = ctx.key
    charged = await ctx.step("charge", _call, f"{k}:charge", {"charge": "ch_1"})
    label = await ctx.step("label", _call, f"{k}:label", "L-42")
    shipped = await ctx.step("ship", _call, f"{k}:ship", True)
    return {"charged": charged, "label": label, "shipped": shipped, "attempt": ctx.attempt}


@registry.task("napper")
async def napper(params: dict[str, Any], ctx: TaskContext) -> str:
    before = await ctx.step("before", _call, f"{ctx.key}:before", 1)
    await ctx.sleep(params["seconds"])
    after = await ctx.step("after", _call, f"{ctx.key}:after", 2)
    return f"{before}+{after}"


@registry.task("quick")
async def quick(params: dict[str, Any], ctx: TaskContext) -> str:
    return "quick"


@registry.task("approval")
async def approval(params: dict[str, Any], ctx: TaskContext) -> Any:
    await ctx.step("ask", _call, f"{ctx.key}:ask", None)
    try:
        decision = await ctx.wait_for("approved", timeout=params.get("timeout"))
    except SignalTimeout:
        return "timed out"
    return {"decision": decision}


@registry.task("big")
async def big(params: dict[str, Any], ctx: TaskContext) -> dict[str, Any]:
    blob = await ctx.step("blob", _call, f"{ctx.key}:blob", b"\x07" * params["size"])
    await ctx.sleep(0.05)  # ends the run: the next one reads the spilled result back
    return {"bytes": len(blob), "sha": hashlib.sha256(blob).hexdigest(), "attempt": ctx.attempt}


@registry.task("fickle", options={"retry_delay_ms": 0})
async def fickle(params: dict[str, Any], ctx: TaskContext) -> str:
    first = "a" if ctx.attempt == 1 else "b"  # not a function of its params: a mismatch
    await ctx.step(first, _call, f"{ctx.key}:{first}", 1)
    await ctx.sleep(0.01)
    return "never"


@registry.task("fickle_wait", options={"retry_delay_ms": 0})
async def fickle_wait(params: dict[str, Any], ctx: TaskContext) -> str:
    first = "a" if ctx.attempt == 1 else "b"  # a changed handler: its replay mismatches
    await ctx.step(first, _call, f"{ctx.key}:{first}", 1)
    await ctx.wait_for("go")
    return "never"


@registry.task("twice_named")
async def twice_named(params: dict[str, Any], ctx: TaskContext) -> str:
    await ctx.step("same", _call, f"{ctx.key}:1", 1)
    await ctx.step("same", _call, f"{ctx.key}:2", 2)
    return "never"


@registry.task("threaded", options={"retry_delay_ms": 0})
def threaded(params: dict[str, Any], ctx: TaskContext) -> list[Any]:
    one = ctx.step_sync("one", _call, f"{ctx.key}:one", 1)
    ctx.sleep_sync(0.05)
    two = ctx.step_sync("two", _call, f"{ctx.key}:two", 2)
    got = ctx.wait_for_sync("go", timeout=30)
    return [one, two, got]


@registry.task("ledger", options={"retry_delay_ms": 0})
async def ledger(params: dict[str, Any], ctx: TaskContext) -> int:
    async def book(amount: int, *, session: Any) -> int:
        CALLS[f"{ctx.key}:book"] += 1
        rows = session.client[params["db"]]["ledger"]
        await rows.insert_one({"task": ctx.key, "amount": amount}, session=session)
        if params.get("abort") and CALLS[f"{ctx.key}:book"] == 1:
            raise RuntimeError("the first transaction aborts")
        return amount

    booked = await ctx.step("book", book, 42, transactional=True)
    if ctx.attempt == 1 and params.get("fail_after"):
        raise RuntimeError("after the step")
    return int(booked)


@registry.task("gate", options={"retry_delay_ms": 3_600_000})
async def gate(params: dict[str, Any], ctx: TaskContext) -> Any:
    if ctx.attempt == 2:  # woken by the signal, it fails before it asks for its wait again
        raise RuntimeError("fails after the wake")
    return await ctx.wait_for("go")


def _nested(levels: int) -> Any:
    value: Any = "bottom"
    for _ in range(levels):
        value = [value]
    return value


@registry.task("deep", options={"retry_delay_ms": 0})
async def deep(params: dict[str, Any], ctx: TaskContext) -> int:
    value = await ctx.step("deep", _call, f"{ctx.key}:deep", _nested(params["levels"]))
    await ctx.sleep(0.01)  # the next run reads it back
    depth = 0
    while isinstance(value, list):
        value, depth = value[0], depth + 1
    return depth


async def _finished(aclient: AsyncTaskClient, key: str, timeout: float = 30) -> Any:
    async with asyncio.timeout(timeout):
        return await aclient.wait(key)


async def test_steps_run_once_and_replay_across_a_retry(
    aclient: AsyncTaskClient, mongo_uri: str, db_name: str
) -> None:
    FAIL_ONCE.add("c1:label")
    async with running_worker(registry, mongo_uri, db_name):
        await aclient.publish("checkout", "c1", {})
        task = await _finished(aclient, "c1")
    assert task.status.value == "succeeded", task
    assert task.result == {
        "charged": {"charge": "ch_1"}, "label": "L-42", "shipped": True, "attempt": 2
    }  # fmt: skip
    assert CALLS["c1:charge"] == 1  # recorded by run 1, replayed by run 2
    assert CALLS["c1:label"] == 2 and CALLS["c1:ship"] == 1
    steps = {s.name: s for s in task.steps}
    assert [s.name for s in task.steps] == ["charge", "label", "ship"]
    assert steps["charge"].state == "done" and steps["charge"].attempts == 1
    assert steps["label"].attempts == 2 and [t.error for t in steps["label"].tries] == [
        "RuntimeError: label failed once".replace("label", "c1:label"),
        None,
    ]
    assert steps["charge"].run_id == task.runs[0].run_id
    assert steps["ship"].run_id == task.runs[1].run_id


def woke_after_its_sleep(task: Any, seconds: float) -> Any:
    """``task`` ran up to its sleep (step 2) of at least ``seconds``, and again once it ended,
    no earlier by the server's clock, to a success; returns the second run."""
    first, second = task.runs
    assert first.state.value == "WAITING" and second.state.value == "SUCCESS"
    nap = task.steps[1]
    assert nap.kind == "sleep" and nap.state == "done" and nap.until is not None
    # the sleep's length from its start, both on the server's clock (not from the run's WAITING
    # record: how soon that lands after the sleep begins is the machine's load)
    assert nap.until - nap.started_at >= dt.timedelta(seconds=seconds)
    assert second.claimed_at >= nap.until  # no earlier, by the server's clock
    assert task.waiting is None
    return second


async def test_sleep_frees_the_slot_and_resumes_on_the_servers_clock(
    aclient: AsyncTaskClient, mongo_uri: str, db_name: str
) -> None:
    async with running_worker(registry, mongo_uri, db_name, concurrency=1) as (_, events):
        await aclient.publish("napper", "n1", {"seconds": 2})
        await events.wait("recorded", key="n1", state="WAITING")
        await aclient.publish("quick", "q1", {})  # the one slot is free while n1 sleeps
        quick_done = await _finished(aclient, "q1")
        waiting = await aclient.get("n1")
        assert waiting is not None and waiting.status.value == "pending"
        assert waiting.waiting is not None and waiting.waiting.step == "sleep#1"
        task = await _finished(aclient, "n1")
    assert task.result == "1+2" and CALLS["n1:before"] == 1 and CALLS["n1:after"] == 1
    second = woke_after_its_sleep(task, seconds=1.9)
    assert quick_done.finished_at < second.claimed_at


async def test_signals_after_the_wait_and_never(
    aclient: AsyncTaskClient, mongo_uri: str, db_name: str
) -> None:
    async with running_worker(registry, mongo_uri, db_name) as (_, events):
        await aclient.publish("approval", "after", {})
        await aclient.publish("approval", "never", {"timeout": 1})
        await events.wait("recorded", key="after", state="WAITING")
        assert await aclient.signal("after", "approved", {"by": "bob"}) is True
        after = await _finished(aclient, "after")
        never = await _finished(aclient, "never")
    assert after.result == {"decision": {"by": "bob"}}
    assert [r.state.value for r in after.runs] == ["WAITING", "SUCCESS"]
    assert never.result == "timed out"
    assert [s.state for s in never.steps] == ["done", "timed_out"]
    assert CALLS["after:ask"] == 1 and CALLS["never:ask"] == 1
    assert [s.name for s in after.signals] == ["approved"]


async def test_a_signal_sent_before_the_wait_is_not_lost(
    aclient: AsyncTaskClient, mongo_uri: str, db_name: str
) -> None:
    await aclient.publish("approval", "early", {})
    assert await aclient.signal("early", "approved", "yes") is False
    async with running_worker(registry, mongo_uri, db_name) as (_, events):
        task = await _finished(aclient, "early")
    assert task.result == {"decision": "yes"}
    assert [r.state.value for r in task.runs] == ["SUCCESS"]  # it never had to wait
    assert not events.matching("waiting", key="early")


async def test_a_failed_run_after_a_wake_is_not_woken_again_by_a_signal(
    aclient: AsyncTaskClient, worker_after: Any
) -> None:
    async with worker_after(registry, aclient.publish("gate", "g1", {}), "g1", state="WAITING") as (
        _,
        events,
    ):
        assert await aclient.signal("g1", "go", 1) is True
        await events.wait("recorded", key="g1", state="FAIL")
        failed = await aclient.get("g1")
        assert failed is not None and failed.status.value == "pending"
        assert failed.waiting is None  # it waits for its retry's backoff, not for a signal
        assert await aclient.signal("g1", "go", 2) is False  # kept, and the backoff stands
        again = await aclient.get("g1")
    assert again is not None and again.next_claim_at == failed.next_claim_at
    assert [r.state.value for r in again.runs] == ["WAITING", "FAIL"]


async def test_a_full_list_of_signals_never_strands_a_wait(
    aclient: AsyncTaskClient, mongo_uri: str, db_name: str
) -> None:
    """1,000 signals no wait takes fill a task's list; the signal its wait needs still lands
    (one more, never two) and wakes it; a task that waits for no more of a name is refused."""
    cap = store_steps.MAX_SIGNALS
    async with running_worker(registry, mongo_uri, db_name) as (_, events):
        await aclient.publish("approval", "full", {})
        await events.wait("recorded", key="full", state="WAITING")
        for i in range(cap):
            assert await aclient.signal("full", f"noise-{i % 7}", i) is False
        with pytest.raises(InvalidTransition, match="signals already"):
            await aclient.signal("full", "noise-0", "one too many")
        assert await aclient.signal("full", "approved", {"by": "ann"}) is True
        with pytest.raises(InvalidTransition, match="signals already"):
            await aclient.signal("full", "approved", "a second is not waited for")
        task = await _finished(aclient, "full")
    assert task.result == {"decision": {"by": "ann"}}
    assert len(task.signals) == cap + 1


async def test_signal_refuses_bad_input_and_finished_tasks(aclient: AsyncTaskClient) -> None:
    with pytest.raises(TaskNotFound):
        await aclient.signal("nope", "approved")
    await aclient.publish("quick", "done-already", {})
    await aclient.cancel("done-already")
    with pytest.raises(InvalidTransition):
        await aclient.signal("done-already", "approved")
    with pytest.raises(InvalidTask, match="name"):
        await aclient.signal("done-already", "")
    with pytest.raises(InvalidTask, match=r"cannot start with '\$'"):  # it would read a field
        await aclient.signal("done-already", "$status")
    with pytest.raises(InvalidTask, match="payload"):
        await aclient.signal("done-already", "x", object())
    with pytest.raises(InvalidTask, match="bytes"):
        await aclient.signal("done-already", "x", "y" * 70_000)


async def test_a_large_result_spills_aside_and_comes_back(
    aclient: AsyncTaskClient, mongo_uri: str, db_name: str
) -> None:
    size = 20 * 1024 * 1024
    side = aclient.collection.database[f"{aclient.collection.name}.steps"]
    async with running_worker(registry, mongo_uri, db_name):
        await aclient.publish("big", "b1", {"size": size})
        task = await _finished(aclient, "b1", timeout=120)
        sealed = {"task": "b1", "expire_at": task.expire_at}
        await wait_for(lambda: side.count_documents(sealed), every=0.05)  # go with the task
    assert task.status.value == "succeeded", task
    blob = b"\x07" * size
    assert task.result == {"bytes": size, "sha": hashlib.sha256(blob).hexdigest(), "attempt": 2}
    assert CALLS["b1:blob"] == 1
    step = task.steps[0]
    assert step.result is None and step.spill is not None and step.spill["chunks"] == 6
    chunks = await side.find({"task": "b1"}, {"n": 1}).to_list()
    assert sorted(c["n"] for c in chunks) == list(range(6))
    assert await side.count_documents(sealed) == 6


async def test_a_small_result_too_deep_for_the_task_document_is_stored_aside(
    aclient: AsyncTaskClient, mongo_uri: str, db_name: str
) -> None:
    # a few hundred bytes as BSON, but nested past what MongoDB stores in a document
    async with running_worker(registry, mongo_uri, db_name):
        for key, levels in (("d1", 250), ("d2", 97), ("d3", 98)):
            await aclient.publish("deep", key, {"levels": levels})
        task, at_most, past = [await _finished(aclient, k) for k in ("d1", "d2", "d3")]
    assert task.status.value == "succeeded", task.error
    assert task.result == 250 and CALLS["d1:deep"] == 1
    assert task.steps[0].spill is not None
    # the most a value stored three levels down may nest (vocabulary.MAX_STORED_DEPTH): inline
    assert at_most.status.value == "succeeded", at_most.error
    assert at_most.result == 97 and at_most.steps[0].spill is None
    assert past.result == 98 and past.steps[0].spill is not None


async def test_replay_rules_fail_the_task_for_good(
    aclient: AsyncTaskClient, mongo_uri: str, db_name: str
) -> None:
    async with running_worker(registry, mongo_uri, db_name):
        await aclient.publish("fickle", "f1", {})
        await aclient.publish("twice_named", "t1", {})
        fickle_task = await _finished(aclient, "f1")
        twice = await _finished(aclient, "t1")
    assert fickle_task.status.value == "failed"
    assert "StepMismatch" in (fickle_task.error or "")
    assert "recorded as 'a' (call); this run asked for 'b'" in (fickle_task.error or "")
    assert [s.name for s in fickle_task.steps] == ["a", "sleep#1"]  # nothing half-written
    # the sleep it was woken from is over: its journal says so, not "waiting"
    assert [s.state for s in fickle_task.steps] == ["done", "done"]
    assert CALLS["f1:b"] == 0
    assert twice.status.value == "failed" and "asked for twice" in (twice.error or "")
    assert [s.name for s in twice.steps] == ["same"] and CALLS["t1:2"] == 0


async def test_a_task_failed_by_its_replay_says_how_its_wait_ended(
    aclient: AsyncTaskClient, mongo_uri: str, db_name: str
) -> None:
    """A signal wait the task was woken from, whose resumed run mismatched before it reached
    it: the failed task's journal shows the wait done with the signal it took."""
    async with running_worker(registry, mongo_uri, db_name) as (_, events):
        await aclient.publish("fickle_wait", "fw1", {})
        await events.wait("recorded", key="fw1", state="WAITING")
        assert await aclient.signal("fw1", "go", {"v": 1}) is True
        task = await _finished(aclient, "fw1")
    assert task.status.value == "failed" and "StepMismatch" in (task.error or "")
    assert [(s.name, s.state, s.result) for s in task.steps] == [
        ("a", "done", 1),
        ("wait:go", "done", {"v": 1}),
    ]


async def test_plain_def_handlers_on_threads(
    aclient: AsyncTaskClient, mongo_uri: str, db_name: str
) -> None:
    async with running_worker(registry, mongo_uri, db_name) as (_, events):
        await aclient.publish("threaded", "th1", {})
        await events.wait("recorded", key="th1", state="WAITING", count=2)  # sleep, signal
        await aclient.signal("th1", "go", [1, 2])
        task = await _finished(aclient, "th1")
    assert task.result == [1, 2, [1, 2]]
    assert CALLS["th1:one"] == 1 and CALLS["th1:two"] == 1
    assert [r.state.value for r in task.runs] == ["WAITING", "WAITING", "SUCCESS"]


@pytest.mark.parametrize("mode", ["fail_after", "abort"])
async def test_a_transactional_steps_writes_commit_with_its_record(
    aclient: AsyncTaskClient, mongo_uri: str, db_name: str, mode: str
) -> None:
    key = f"l-{mode}"
    async with running_worker(registry, mongo_uri, db_name):
        await aclient.publish("ledger", key, {"db": db_name, mode: True})
        task = await _finished(aclient, key)
    assert task.status.value == "succeeded" and task.result == 42, task
    mongo: AsyncMongoClient[dict[str, Any]] = aclient.mongo
    rows = await mongo[db_name]["ledger"].find({"task": key}).to_list()
    assert len(rows) == 1  # the aborted try (abort) or the replay (fail_after) wrote nothing
    step = task.steps[0]
    assert step.state == "done" and step.transactional is True and step.result == 42
    assert CALLS[f"{key}:book"] == (2 if mode == "abort" else 1)
    raw = await aclient.collection.find_one({"_id": key})
    assert raw is not None
    committed = next(r for r in raw["runs"] if r["run_id"] == step.run_id)
    assert "txn" not in committed  # its session is back in the pool: no takeover may kill it


async def test_step_writes_and_signals_pass_the_collections_validator(
    aclient: AsyncTaskClient, mongo_uri: str, db_name: str
) -> None:
    await aclient.init_collection(validator=True)  # the $jsonSchema generated from models.py
    FAIL_ONCE.add("v1:label")
    async with running_worker(registry, mongo_uri, db_name) as (_, events):
        await aclient.publish("checkout", "v1", {})  # a failed step, then done ones
        await aclient.publish("approval", "v2", {"timeout": 30})  # a wait, then a signal
        await aclient.publish("big", "v3", {"size": 100_000})  # a spill, a sleep
        await events.wait("recorded", key="v2", state="WAITING")
        await aclient.signal("v2", "approved", {"by": "val"})
        done = [await _finished(aclient, k) for k in ("v1", "v2", "v3")]
    assert [t.status.value for t in done] == ["succeeded"] * 3, done
    assert all(t.complete for t in done), [t.problems for t in done]


async def test_task_events_carry_the_steps_and_waits_when_asked(
    aclient: AsyncTaskClient, mongo_uri: str, db_name: str
) -> None:
    seen: dict[bool, list[TaskEvent]] = {True: [], False: []}

    async def follow(steps: bool, opened: asyncio.Event) -> None:
        names = ["checkout", "approval"]
        async for event in events_of(aclient.collection, names, opened=opened, steps=steps):
            seen[steps].append(event)
            if event.key == "ev-a" and event.status == "succeeded":
                return

    opened = {True: asyncio.Event(), False: asyncio.Event()}
    followers = [asyncio.create_task(follow(b, opened[b])) for b in (True, False)]
    await asyncio.gather(*(o.wait() for o in opened.values()))
    FAIL_ONCE.add("ev-c:label")
    async with running_worker(registry, mongo_uri, db_name) as (_, events):
        await aclient.publish("checkout", "ev-c", {})
        await _finished(aclient, "ev-c")
        await aclient.publish("approval", "ev-a", {})
        await events.wait("recorded", key="ev-a", state="WAITING")
        await aclient.signal("ev-a", "approved", "ok")
        await asyncio.wait_for(asyncio.gather(*followers), 30)
    steps = [
        (e.key, s["index"], s["name"], s["state"], s["attempts"])
        for e in seen[True]
        for s in e.steps
    ]
    assert steps == [
        ("ev-c", 0, "charge", "done", 1),
        ("ev-c", 1, "label", "failed", 1),
        ("ev-c", 1, "label", "done", 2),
        ("ev-c", 2, "ship", "done", 1),
        ("ev-a", 0, "ask", "done", 1),
        ("ev-a", 1, "wait:approved", "waiting", 0),
        ("ev-a", 1, "wait:approved", "done", 1),
    ]
    assert all("result" not in s for e in seen[True] for s in e.steps)  # client.get reads it
    failed = next(s for e in seen[True] for s in e.steps if s["state"] == "failed")
    assert failed["error"] == "RuntimeError: ev-c:label failed once" and failed["ms"] >= 0
    began = [e for e in seen[True] if e.waiting is not None]
    assert len(began) == 1 and began[0].key == "ev-a" and began[0].status == "pending"
    assert began[0].waiting["signal"] == "approved" and began[0].waiting["index"] == 1
    as_json = json.loads(json.dumps(began[0].to_json()))
    assert as_json["waiting"]["until"].startswith("9999-01-01")
    assert as_json["steps"][0]["name"] == "wait:approved"
    plain = seen[False]  # not asked for: the status changes only, none of the steps
    assert all(not e.steps and e.waiting is None for e in plain)
    assert [e.status for e in plain if e.key == "ev-a"] == [
        "pending",
        "running",
        "pending",
        "running",
        "succeeded",
    ]
