"""A worker runs a ``transactional=True`` handler: its writes (with ``ctx.session``) and the run's
SUCCESS commit together; a ``Retry`` or an unstorable result aborts them. Business writes are
counted, not runs."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from harness import running_worker
from pymongo.errors import OperationFailure

from mtask import AsyncTaskClient, TaskClient
from mtask.errors import InvalidTask
from mtask.registry import Registry, Retry, TaskContext
from mtask.store import Outcome, RunState, claim, claim_locked
from mtask.store.transactional import begin_run_transaction, complete_in_transaction

registry = Registry()


@registry.task("charge", transactional=True)
async def charge(params: dict[str, Any], ctx: TaskContext) -> dict[str, Any]:
    db = ctx.session.client[params["db"]]
    await db["ledger"].insert_one({"task": ctx.key, "attempt": ctx.attempt}, session=ctx.session)
    await db["counters"].update_one(
        {"_id": "charges"}, {"$inc": {"n": 1}}, upsert=True, session=ctx.session
    )
    if params.get("sleep"):  # longer than the ping interval
        await db["calls"].insert_one({"task": ctx.key})  # outside the transaction: every call
        await asyncio.sleep(params["sleep"])
    if params.get("retry_first") and ctx.attempt == 1:
        raise Retry("declined, try again", delay=0)
    return {"charged": ctx.key, "big": "x" * params.get("pad", 0)}


@registry.task("ends", transactional=True)
async def ends(params: dict[str, Any], ctx: TaskContext) -> str:
    db = ctx.session.client[params["db"]]
    await db["ledger"].insert_one({"task": ctx.key, "attempt": ctx.attempt}, session=ctx.session)
    if params["how"] == "abort":
        await ctx.session.abort_transaction()
    else:
        await ctx.session.commit_transaction()
    return "done"


@pytest.fixture
def prepared(client: TaskClient) -> TaskClient:
    client.ensure_indexes()
    client.db.create_collection("ledger")
    client.db["counters"].insert_one({"_id": "charges", "n": 0})
    return client


def business(client: TaskClient) -> tuple[int, list[tuple[str, int]]]:
    counter = client.db["counters"].find_one({"_id": "charges"})
    assert counter is not None
    ledger = sorted((d["task"], d["attempt"]) for d in client.db["ledger"].find())
    return counter["n"], ledger


async def test_writes_and_success_commit_together(
    mongo_uri: str, db_name: str, prepared: TaskClient
) -> None:
    async with running_worker(registry, mongo_uri, db_name, concurrency=4) as (_, events):
        for i in range(4):
            prepared.publish("charge", f"c{i}", {"db": db_name})
        for i in range(4):
            await events.wait("recorded", key=f"c{i}")
    assert business(prepared) == (4, [(f"c{i}", 1) for i in range(4)])
    for i in range(4):
        task = prepared.get(f"c{i}")
        assert task is not None and task.status == "succeeded"
        assert task.result == {"charged": f"c{i}", "big": ""}
        assert [r.state for r in task.runs] == ["SUCCESS"]


async def test_retry_aborts_the_attempts_writes(
    mongo_uri: str, db_name: str, prepared: TaskClient
) -> None:
    async with running_worker(registry, mongo_uri, db_name) as (_, events):
        prepared.publish("charge", "c", {"db": db_name, "retry_first": True})
        await events.wait("recorded", key="c", state="SUCCESS")
    assert business(prepared) == (1, [("c", 2)])  # the first attempt's writes never landed
    task = prepared.get("c")
    assert task is not None and [r.state for r in task.runs] == ["FAIL", "SUCCESS"]


async def test_an_unstorable_result_aborts_the_writes(
    mongo_uri: str, db_name: str, prepared: TaskClient
) -> None:
    async with running_worker(registry, mongo_uri, db_name, max_result_bytes=1000) as (_, ev):
        prepared.publish("charge", "c", {"db": db_name, "pad": 5000})
        await ev.wait("recorded", key="c")
    assert business(prepared) == (0, [])
    task = prepared.get("c")
    assert task is not None and task.status == "failed" and "limit is 1000" in (task.error or "")


async def left_open_then_rescued(
    ac: AsyncTaskClient, run_id: str, mongo_uri: str, db_name: str
) -> None:
    """Task ``c``'s run ``run_id`` writes in its transaction and its fenced SUCCESS, and is
    frozen before its commit; a worker then takes the task over, and the zombie's commit is
    refused (its transaction was killed)."""
    zombie = ac.mongo.start_session()
    lsid = zombie.session_id["id"]
    assert await ac._run(begin_run_transaction("c", run_id, "zombie", await ac.now(), lsid))
    await zombie.start_transaction()
    await ac.db["ledger"].insert_one({"task": "c", "attempt": 1}, session=zombie)
    await ac.db["counters"].update_one({"_id": "charges"}, {"$inc": {"n": 1}}, session=zombie)
    success = Outcome("c", run_id, RunState.SUCCESS, result="zombie", worker_id="zombie")
    fenced = complete_in_transaction(success, await ac.now())
    assert await ac._driver.run(fenced, zombie) is not None  # then frozen: no commit
    async with running_worker(registry, mongo_uri, db_name) as (_, events):
        await events.wait("recorded", key="c", state="SUCCESS", timeout=40)
    with pytest.raises(OperationFailure):
        await zombie.commit_transaction()  # killed
    await zombie.end_session()


async def test_a_handler_longer_than_the_ping_interval_runs_once(
    mongo_uri: str, db_name: str, prepared: TaskClient
) -> None:
    """Pings write the task document; one landing while the transaction is open would make its
    fenced SUCCESS meet a write conflict, and the body run again (and again: a livelock until
    the transaction's time limit). The run's lease is extended once when its transaction
    starts, and not pinged while it is open."""
    options = {"ping_interval_ms": 100, "worker_timeout_ms": 5000}
    async with running_worker(registry, mongo_uri, db_name) as (_, events):
        prepared.publish("charge", "c", {"db": db_name, "sleep": 0.8}, options=options)
        await events.wait("recorded", key="c", timeout=30)
    assert business(prepared) == (1, [("c", 1)])
    assert prepared.db["calls"].count_documents({}) == 1  # the body ran once
    task = prepared.get("c")
    assert task is not None and [r.state for r in task.runs] == ["SUCCESS"]


def rescued_once(prepared: TaskClient) -> None:
    """Task ``c`` charged once, by the rescuer's run (the zombie's writes never landed)."""
    assert business(prepared) == (1, [("c", 2)])
    task = prepared.get("c")
    assert task is not None and task.status == "succeeded" and task.result != "zombie"
    assert [r.state for r in task.runs] == ["TIMEOUT", "SUCCESS"]


async def test_a_claim_kills_a_transaction_left_open_on_the_task_document(
    mongo_uri: str, db_name: str, prepared: TaskClient
) -> None:
    """A run frozen or killed between its fenced SUCCESS and its commit leaves a transaction
    open that has written the task document: a claim taking the task over waits for it, and
    the server keeps it for a minute or more. The claim runs out of time (CLAIM_TIMEOUT_S),
    the claimer kills the transactions of runs whose lease ended, and the next claim goes
    through: the zombie's writes never land, the rescuer's once."""
    options = {"worker_timeout_ms": 1000, "ping_interval_ms": 200}
    prepared.publish("charge", "c", {"db": db_name}, options=options)
    async with AsyncTaskClient(mongo_uri, database=db_name) as ac:
        docs = await ac._run(claim(["c"], ["charge"], "zombie", await ac.now()))
        await left_open_then_rescued(ac, docs[0]["claim_run_id"], mongo_uri, db_name)
    rescued_once(prepared)


@pytest.mark.parametrize("how", ["abort", "commit"])
async def test_a_handler_ending_the_transaction_itself_fails_clearly(
    mongo_uri: str, db_name: str, prepared: TaskClient, how: str
) -> None:
    """The run's SUCCESS must commit in the handler's transaction: a handler that aborted it
    (its writes gone) or committed it (its writes landed, the SUCCESS not yet written) gets a
    clear, permanent failure instead of a SUCCESS written outside any transaction."""
    async with running_worker(registry, mongo_uri, db_name) as (_, events):
        prepared.publish("ends", "e", {"db": db_name, "how": how})
        await events.wait("recorded", key="e")
    task = prepared.get("e")
    assert task is not None and task.status == "failed"
    assert [r.state for r in task.runs] == ["FAIL"]
    assert "ended its transaction itself" in (task.error or "")
    assert "Traceback" not in (task.error or "")
    landed = prepared.db["ledger"].count_documents({"task": "e"})
    assert landed == (1 if how == "commit" else 0)


async def test_a_sequence_claim_kills_a_transaction_left_open_on_its_head(
    mongo_uri: str, db_name: str, prepared: TaskClient
) -> None:
    """As above for a task of a sequence, claimed with its group's lock (``claim_locked``):
    that claim too waits for the open transaction, runs out of time, and must kill it."""
    prepared.set_limit("charge", group_concurrency=1)
    options = {"worker_timeout_ms": 1000, "ping_interval_ms": 200, "group": "g"}
    prepared.publish("charge", "c", {"db": db_name}, options=options)
    async with AsyncTaskClient(mongo_uri, database=db_name) as ac:
        now = await ac.now()
        docs, _, _ = await ac._run(claim_locked({"c": ("charge", "g")}, ["charge"], "zombie", now))
        await left_open_then_rescued(ac, docs[0]["claim_run_id"], mongo_uri, db_name)
    rescued_once(prepared)


def test_a_transactional_handler_must_be_async_and_take_ctx() -> None:
    reg = Registry()
    with pytest.raises(InvalidTask, match="must be an async def taking"):

        @reg.task("sync", transactional=True)
        def sync(params: dict[str, Any], ctx: TaskContext) -> None: ...

    with pytest.raises(InvalidTask, match="must be an async def taking"):

        @reg.task("no_ctx", transactional=True)
        async def no_ctx(params: dict[str, Any]) -> None: ...
