"""A run's live output, end to end on a real replica set: ``ctx.progress`` / ``ctx.log`` /
``ctx.emit`` written under the run's fence, and read back in order, exactly once, resumably
(``client.stream``), across a reconnect, a retry and a takeover."""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import signal
import tracemalloc
from typing import Any

import pytest
from bson.decimal128 import Decimal128
from harness import running_worker, wait_for, worker_process
from pymongo.errors import OperationFailure

from mtask import AsyncTaskClient, TaskClient, driver, metrics
from mtask.errors import InvalidTask, TaskNotFound
from mtask.follow.events import events as events_of
from mtask.registry import Registry, Retry, TaskContext
from mtask.store import claim
from mtask.store import output as store_output

registry = Registry()
RELEASE: dict[str, asyncio.Event] = {}


@registry.task("chunks")
async def chunks(params: dict[str, int], ctx: TaskContext) -> int:
    for i in range(1, params["n"] + 1):
        ctx.emit(i)
        if i % 10 == 0:
            await asyncio.sleep(0.002)
        if i == params.get("pause_at"):
            await RELEASE[ctx.key].wait()
    return params["n"]


@registry.task("progress_storm")
async def progress_storm(params: dict[str, int], ctx: TaskContext) -> str:
    n = params["n"]
    for i in range(1, n + 1):
        ctx.progress(i / n, f"{i} of {n}")
        if i % 5000 == 0:
            await asyncio.sleep(0)
    return "done"


@registry.task("loud")
def loud(params: dict[str, int], ctx: TaskContext) -> int:
    tracemalloc.start()
    try:
        for i in range(params["lines"]):
            ctx.log.info("line", i=i, pad="x" * 100)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak


@registry.task("twice")
async def twice(params: dict[str, Any], ctx: TaskContext) -> str:
    ctx.log.warning("attempt", n=ctx.attempt)
    ctx.emit(f"a{ctx.attempt}")
    if ctx.attempt == 1:
        raise Retry("once more", delay=0)
    return "ok"


@registry.task("txn_talk", transactional=True)
async def txn_talk(params: dict[str, Any], ctx: TaskContext) -> str:
    await ctx.session.client[params["db"]]["ledger"].insert_one(
        {"attempt": ctx.attempt}, session=ctx.session
    )
    ctx.log.info("in the transaction", attempt=ctx.attempt)
    ctx.emit(f"t{ctx.attempt}")
    ctx.progress(1.0, f"attempt {ctx.attempt}")
    if ctx.attempt == 1:
        raise Retry("again", delay=0)
    return "ok"


async def test_a_transactional_runs_output_commits_with_its_success_or_not_at_all(
    mongo_uri: str, db_name: str, aclient: AsyncTaskClient, client: TaskClient
) -> None:
    client.db.create_collection("ledger")
    async with running_worker(registry, mongo_uri, db_name) as (_, events):
        await aclient.publish("txn_talk", "x", {"db": db_name})
        await events.wait("recorded", key="x", state="SUCCESS")
    entries = [e async for e in aclient.stream("x")]
    assert [(e.seq, e.attempt, e.kind) for e in entries] == [(1, 2, "log"), (2, 2, "chunk")]
    assert [d["attempt"] for d in client.db["ledger"].find()] == [2]  # as the business write
    task = await aclient.get("x")
    assert task is not None and task.progress is not None
    assert task.progress.label == "attempt 2"


@registry.task("steps")
async def steps(params: dict[str, Any], ctx: TaskContext) -> str:
    for i in range(1, 4):
        ctx.progress(i / 3, f"{i} of 3")
        await asyncio.sleep(0.4)  # longer than the writer's interval: one write each
    return "ok"


async def test_task_events_carry_progress_when_asked(
    mongo_uri: str, db_name: str, aclient: AsyncTaskClient
) -> None:
    opened = asyncio.Event()
    seen: list[Any] = []

    async def follow() -> None:
        async for event in events_of(aclient.collection, opened=opened, progress=True):
            seen.append(event)
            if event.status == "succeeded":
                return

    follower = asyncio.create_task(follow())
    await opened.wait()
    async with running_worker(registry, mongo_uri, db_name) as (_, events):
        await aclient.publish("steps", "e", {})
        await wait_for(lambda: metrics.RUNS_IN_PROGRESS._value.get() == 1)  # while it runs
        await events.wait("recorded", key="e")
        await asyncio.wait_for(follower, 30)
    assert metrics.RUNS_IN_PROGRESS._value.get() == 0
    labels = [e.progress["label"] for e in seen if e.progress is not None]
    assert labels and labels[-1] == "3 of 3" and labels == sorted(labels)
    assert seen[0].status == "pending" and seen[-1].status == "succeeded"
    assert all(e.progress["run_id"] for e in seen if e.progress is not None)
    assert "progress" in next(e for e in seen if e.progress).to_json()


async def test_a_stream_resumes_after_the_last_id_exactly_once(
    mongo_uri: str, db_name: str, aclient: AsyncTaskClient
) -> None:
    RELEASE["s"] = asyncio.Event()
    async with running_worker(registry, mongo_uri, db_name) as (_, events):
        await aclient.publish("chunks", "s", {"n": 1000, "pause_at": 400})
        first: list[int] = []
        stream = aclient.stream("s")
        async for entry in stream:
            first.append(entry.data)
            if len(first) == 300:
                break  # the reader goes away while the handler is still emitting
        await stream.aclose()  # type: ignore[attr-defined]
        assert first == list(range(1, 301))
        last = 300
        RELEASE["s"].set()
        rest = [(e.seq, e.data) async for e in aclient.stream("s", after=last)]
        await events.wait("recorded", key="s")
    assert rest == [(i, i) for i in range(301, 1001)]
    task = await aclient.get("s")
    assert task is not None and task.output_seq == 1000
    assert task.runs[-1].output is not None and task.runs[-1].output.chunks == 1000


def test_the_sync_stream_reads_a_finished_task_and_ends(client: TaskClient, drain: Any) -> None:
    asyncio.run(drain(registry, lambda: client.publish("chunks", "f", {"n": 25}), "f"))
    assert [e.data for e in client.stream("f")] == list(range(1, 26))
    assert [e.seq for e in client.stream("f", after=20)] == [21, 22, 23, 24, 25]
    assert [e.seq for e in client.output("f", after=5, limit=3)] == [6, 7, 8]
    with pytest.raises(TaskNotFound):
        next(iter(client.stream("no-such-task")))
    with pytest.raises(InvalidTask, match="unknown output kind 'logs'"):
        client.output("f", kinds=["logs"])


async def test_progress_is_coalesced_and_the_last_value_lands(
    mongo_uri: str, db_name: str, aclient: AsyncTaskClient, client: TaskClient
) -> None:
    """100,000 calls; the profiler counts the updates that wrote progress (plain updates: a
    write of progress alone returns no document)."""
    client.db.command("profile", 2)
    try:
        async with running_worker(registry, mongo_uri, db_name) as (worker, events):
            await aclient.publish("progress_storm", "p", {"n": 100_000})
            await events.wait("recorded", key="p")
            writes = worker.parts.outputs.writes
    finally:
        client.db.command("profile", 0)
    profiled = list(
        client.db["system.profile"].find(
            {"ns": f"{db_name}.tasks", "op": "update", "command.u.$set.progress": {"$exists": True}}
        )
    )
    assert 1 <= len(profiled) <= writes <= 50
    task = await aclient.get("p")
    assert task is not None and task.progress is not None
    assert (task.progress.fraction, task.progress.label) == (1.0, "100000 of 100000")


async def test_the_log_is_capped_with_a_marker_and_memory_stays_flat(
    mongo_uri: str, db_name: str, aclient: AsyncTaskClient
) -> None:
    async with running_worker(registry, mongo_uri, db_name) as (_, events):
        await aclient.publish("loud", "l", {"lines": 100_000})
        await events.wait("recorded", key="l")
    task = await aclient.get("l")
    assert task is not None and task.runs[-1].output is not None
    counts = task.runs[-1].output
    assert (counts.logs, counts.logs_dropped) == (1001, 100_000 - 1000)
    lines = [e async for e in aclient.stream("l")]
    assert len(lines) == 1001 and lines[-1].fields == {"truncated": True}
    assert "log truncated" in (lines[-1].message or "")
    # 100,000 kept lines would hold tens of MB; the cap keeps the buffer to its 1,000
    assert task.result < 5_000_000


async def test_a_retry_keeps_the_earlier_runs_output_tagged(
    aclient: AsyncTaskClient, drain: Any
) -> None:
    await drain(registry, aclient.publish("twice", "t", {}), "t", state="SUCCESS")
    entries = [e async for e in aclient.stream("t")]
    assert [(e.seq, e.attempt, e.kind) for e in entries] == [
        (1, 1, "log"),
        (2, 1, "chunk"),
        (3, 2, "log"),
        (4, 2, "chunk"),
    ]
    assert [e.data for e in entries if e.kind == "chunk"] == ["a1", "a2"]
    assert len({e.run_id for e in entries}) == 2


async def test_a_reset_tasks_output_goes_on_after_the_earlier_runs(
    mongo_uri: str, db_name: str, aclient: AsyncTaskClient
) -> None:
    """``on_conflict="reset"`` kept only ``_id`` and ``created_at``: the new run numbered its
    output from 1 again, onto the old run's entries (a duplicate key), and all of it was lost."""
    async with running_worker(registry, mongo_uri, db_name) as (_, events):
        await aclient.publish("chunks", "r", {"n": 2})
        await events.wait("recorded", key="r", state="SUCCESS")
        await aclient.publish("chunks", "r", {"n": 3}, on_conflict="reset")
        await events.wait("recorded", key="r", state="SUCCESS", count=2)
    entries = [e async for e in aclient.stream("r")]
    assert [(e.seq, e.data) for e in entries] == [(1, 1), (2, 2), (3, 1), (4, 2), (5, 3)]
    assert len({e.run_id for e in entries}) == 2
    task = await aclient.get("r")
    assert task.output_seq == 5 and task.result == 3


@registry.task("rows")
async def rows(params: dict[str, Any], ctx: TaskContext) -> str:
    row: dict[str, Any] = {}
    for i in range(3):  # a reused buffer
        row["i"] = i
        ctx.emit(row)
    ctx.log.info("said", row=row)
    row["day"] = dt.date(2026, 1, 1)  # changed after the calls into what BSON cannot store
    return "done"


async def test_what_a_handler_changes_after_saying_it_changes_nothing(
    mongo_uri: str, db_name: str, aclient: AsyncTaskClient
) -> None:
    """The buffer held references: the three chunks were stored as the last one, and the
    date set afterwards broke the write, which escaped the run's end: its SUCCESS was never
    recorded (a TIMEOUT once the lease ran out, on every retry)."""
    async with running_worker(registry, mongo_uri, db_name) as (_, events):
        await aclient.publish("rows", "r", {})
        await events.wait("recorded", key="r", state="SUCCESS")
    entries = [e async for e in aclient.stream("r")]
    assert [e.data for e in entries if e.kind == "chunk"] == [{"i": 0}, {"i": 1}, {"i": 2}]
    assert [e.fields for e in entries if e.kind == "log"] == [{"row": {"i": 2}}]


@registry.task("hello")
async def hello(params: dict[str, Any], ctx: TaskContext) -> str:
    ctx.log.info("hello")
    ctx.emit("world")
    return "done"


async def test_a_task_whose_output_seq_is_no_int_still_records_its_outcome(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    """An ``output_seq`` edited into a decimal, NaN or 1e19 made the output write raise
    something other than a MongoDB error; it escaped the run's end and its outcome was never
    recorded. The output is dropped, the outcome stands."""
    values = {"decimal": Decimal128("5"), "nan": float("nan"), "huge": 1e19}
    for key, value in values.items():
        client.publish("hello", key, {})
        client.collection.update_one({"_id": key}, {"$set": {"output_seq": value}})
    async with running_worker(registry, mongo_uri, db_name) as (worker, events):
        for key in values:
            await events.wait("recorded", key=key, state="SUCCESS")
        assert worker._crash is None
    assert {client.get(key).result for key in values} == {"done"}


async def test_a_key_published_again_numbers_its_output_after_entries_left_behind(
    mongo_uri: str, db_name: str, aclient: AsyncTaskClient, client: TaskClient
) -> None:
    """A task removed before its entries (retention's TTL passes are not one operation with
    the entries', or by hand) and its key published again: the new run numbered from 1 onto
    the entries left behind (a duplicate key), and all of its output was lost."""
    async with running_worker(registry, mongo_uri, db_name) as (_, events):
        await aclient.publish("chunks", "r", {"n": 2})
        await events.wait("recorded", key="r", state="SUCCESS")
        client.collection.delete_one({"_id": "r"})
        await aclient.publish("chunks", "r", {"n": 3})
        await events.wait("recorded", key="r", state="SUCCESS", count=2)
    entries = [e async for e in aclient.stream("r")]
    assert [(e.seq, e.data) for e in entries] == [(1, 1), (2, 2), (3, 1), (4, 2), (5, 3)]
    assert (await aclient.get("r")).output_seq == 5


async def test_output_is_removed_with_the_task(
    mongo_uri: str, db_name: str, aclient: AsyncTaskClient, client: TaskClient
) -> None:
    async with running_worker(registry, mongo_uri, db_name) as (_, events):
        await aclient.publish("chunks", "r", {"n": 5})
        await events.wait("recorded", key="r")
    output = client.db["tasks.output"]
    task = client.collection.find_one({"_id": "r"})
    assert task is not None

    def sealed() -> bool:
        return {d.get("expire_at") for d in output.find({"task": "r"})} == {task["expire_at"]}

    await wait_for(sealed)  # the seal follows the outcome
    assert await aclient.purge(keys=["r"]) == 1
    assert output.count_documents({"task": "r"}) == 0


async def test_a_frozen_runs_output_stops_at_its_lease_and_the_stream_goes_on(
    mongo_uri: str, db_name: str, aclient: AsyncTaskClient, client: TaskClient
) -> None:
    """Worker A is SIGSTOPped mid-run past its lease; B takes the task over. A is resumed:
    none of its output lands after B's run began, and one reader sees one contiguous stream."""
    options = {"worker_timeout_ms": 1500, "ping_interval_ms": 300, "max_retries": 5}
    await aclient.publish("chatter", "z", {"count": 150, "every_ms": 20}, options=options)
    seen: list[Any] = []

    async def read() -> None:
        async for entry in aclient.stream("z"):
            seen.append(entry)

    reader = asyncio.create_task(read())
    with worker_process(mongo_uri, db_name, "--concurrency", "1") as a:
        await wait_for(lambda: len(seen) >= 20, timeout=30)
        os.kill(a.pid, signal.SIGSTOP)
        try:
            with worker_process(mongo_uri, db_name, "--concurrency", "1"):
                await asyncio.wait_for(reader, 60)
        finally:
            os.kill(a.pid, signal.SIGCONT)
    task = client.collection.find_one({"_id": "z"})
    assert task is not None and task["status"] == "succeeded"
    first, second = task["runs"][0]["run_id"], task["runs"][-1]["run_id"]
    assert first != second and task["runs"][0]["state"] == "TIMEOUT"
    # A was resumed before it was stopped for good: whatever it still tried to write is in
    stored = list(client.db["tasks.output"].find({"task": "z"}).sort("seq"))
    assert [d["seq"] for d in stored] == list(range(1, len(stored) + 1))
    assert [e.seq for e in seen] == [d["seq"] for d in stored]  # nothing lost, none twice
    a_seqs = [d["seq"] for d in stored if d["run_id"] == first]
    b_seqs = [d["seq"] for d in stored if d["run_id"] == second]
    assert a_seqs and b_seqs and max(a_seqs) < min(b_seqs)  # A wrote nothing after B began
    assert task["progress"]["run_id"] == second and task["progress"]["fraction"] == 1.0
    b_first = next(d for d in stored if d["run_id"] == second)
    assert b_first["attempt"] == 2 and isinstance(b_first["at"], dt.datetime)


async def test_output_writes_pass_the_collections_validator(
    mongo_uri: str, db_name: str, aclient: AsyncTaskClient, client: TaskClient
) -> None:
    client.init_collection(validator=True)  # the $jsonSchema generated from models.py
    async with running_worker(registry, mongo_uri, db_name) as (_, events):
        await aclient.publish("steps", "v", {})
        await aclient.publish("twice", "w", {})
        await events.wait("recorded", key="v")
        await events.wait("recorded", key="w", state="SUCCESS")
    task = await aclient.get("v")
    assert task is not None and task.progress is not None and task.progress.fraction == 1.0
    task = await aclient.get("w")
    assert task is not None and task.output_seq == 4 and task.runs[-1].output is not None


def test_a_batch_sent_again_is_written_once_and_a_stale_lease_writes_nothing(
    client: TaskClient,
) -> None:
    """``store.output.write`` on the real server: the same batch number twice (a reply lost
    after its commit) stores its entries once; a run whose lease has expired by the server's
    clock stores nothing."""

    client.publish("n", "b", {})
    now = client.now()
    run = {"run_id": "r1", "worker_id": "w", "state": "RUNNING", "claimed_at": now}
    lease = {"lease_expires_at": now + dt.timedelta(minutes=5)}
    client.collection.update_one(
        {"_id": "b"}, {"$set": {"status": "running", "runs": [{**run, **lease}]}}
    )
    sync = driver.SyncDriver(driver.collections(client.db))
    entries = [{"kind": "chunk", "data": "x"}, {"kind": "chunk", "data": "y"}]

    def write(batch: int) -> bool:
        op = store_output.write(
            "b", "r1", 1, batch, progress=None, counts={"chunks": 2}, entries=entries,
            expire_at=None, now=now,
        )  # fmt: skip
        with client.mongo.start_session() as session:
            return bool(session.with_transaction(lambda s: sync.run(op, s)))

    assert write(1) and write(1)  # the second is answered, not applied
    assert write(2)
    stored = [d["data"] for d in client.db["tasks.output"].find({"task": "b"}).sort("seq")]
    assert stored == ["x", "y", "x", "y"]  # batches 1 and 2, once each
    assert client.collection.find_one({"_id": "b"})["output_seq"] == 4  # type: ignore[index]
    expired = {"lease_expires_at": now - dt.timedelta(seconds=1)}
    client.collection.update_one({"_id": "b"}, {"$set": {"runs": [{**run, **expired}]}})
    assert not write(3)
    assert client.db["tasks.output"].count_documents({"task": "b"}) == 4


async def test_each_run_that_writes_lines_records_the_session_of_its_transactions(
    aclient: AsyncTaskClient, drain: Any
) -> None:
    """A run's lines and chunks are written in transactions of one session, whose id is on its
    run entry (``output_txn``) before the first; progress alone, none. (A run that ended on
    its own worker gives its session back to the driver's pool: a later run may use it.)"""
    await drain(registry, aclient.publish("twice", "t", {}), "t", state="SUCCESS")
    await drain(registry, aclient.publish("progress_storm", "p", {"n": 10}), "p")
    runs = (await aclient.collection.find_one({"_id": "t"}))["runs"]  # type: ignore[index]
    sessions = [r.get("output_txn") for r in runs]
    assert len(runs) == 2 and None not in sessions, runs
    progress_only = await aclient.collection.find_one({"_id": "p"})
    assert progress_only is not None and "output_txn" not in progress_only["runs"][0]


async def test_a_claim_kills_an_output_transaction_left_open_on_the_task_document(
    mongo_uri: str, db_name: str, aclient: AsyncTaskClient, caplog: pytest.LogCaptureFixture
) -> None:
    """A run frozen or killed between its output transaction's fenced update and its commit
    leaves that transaction open, holding the task document, and the server keeps it for a
    minute or more: a claim taking the task over waits for it. With the session recorded on
    the run entry, the claim runs out of time, the claimer kills it, and the next claim goes
    through, long before the server would have given it up; the zombie's lines never land."""
    options = {"worker_timeout_ms": 1000, "ping_interval_ms": 200}
    await aclient.publish("chunks", "c", {"n": 3}, options=options)
    docs = await aclient._run(claim(["c"], ["chunks"], "zombie", await aclient.now()))
    run_id = docs[0]["claim_run_id"]
    zombie = aclient.mongo.start_session()
    recorded = store_output.record_session("c", run_id, zombie.session_id["id"])
    assert await aclient._run(recorded)
    await zombie.start_transaction()
    said = store_output.write(
        "c", run_id, 1, 1, progress=None, counts={"chunks": 1},
        entries=[{"kind": "chunk", "data": "zombie"}], expire_at=None, now=await aclient.now(),
    )  # fmt: skip
    assert await aclient._driver.run(said, zombie)  # then frozen: no commit
    with caplog.at_level("WARNING", logger="mtask"):
        async with running_worker(registry, mongo_uri, db_name) as (_, events):
            await events.wait("recorded", key="c", state="SUCCESS", timeout=40)
    assert "killed 1 open transaction(s)" in caplog.text
    with pytest.raises(OperationFailure):
        await zombie.commit_transaction()  # killed
    await zombie.end_session()
    task = await aclient.get("c")
    assert task is not None and [r.state for r in task.runs] == ["TIMEOUT", "SUCCESS"]
    stored = [e.data async for e in aclient.stream("c")]
    assert stored == [1, 2, 3]  # the rescuer's, numbered from 1: the zombie's never landed
