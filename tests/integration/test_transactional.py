"""Transactional completion against the real server, without a worker: a handler's writes and
its run's SUCCESS commit together, fenced by the run (mtask/worker/running/transactional.py).
Business writes are counted, not runs."""

from __future__ import annotations

import asyncio
import datetime as dt
from typing import Any

import pytest
from pymongo.asynchronous.client_session import AsyncClientSession
from pymongo.errors import OperationFailure

from mtask import AsyncTaskClient
from mtask.errors import LeaseLost
from mtask.registry import Retry
from mtask.store import CLAIMED_FIELDS, Outcome, RunState, claim, finish_update
from mtask.store.transactional import (
    begin_run_transaction,
    complete_filter_and_pipeline,
    stale_sessions,
)
from mtask.worker.running.transactional import (
    RunFence,
    TransactionTooLong,
    complete_transactionally,
)

Doc = dict[str, Any]


@pytest.fixture
async def ac(aclient: AsyncTaskClient) -> AsyncTaskClient:
    await aclient.ensure_indexes()
    await aclient.db.create_collection("ledger")
    await aclient.db["counters"].insert_one({"_id": "charges", "n": 0})
    return aclient


async def claimed(ac: AsyncTaskClient, key: str, worker: str) -> str:
    docs = await ac._run(claim([key], ["charge"], worker, await ac.now()))
    assert len(docs) == 1
    return str(docs[0]["claim_run_id"])


def charge(ac: AsyncTaskClient, key: str, calls: list[str], then: Any = None) -> Any:
    """A business handler: one ledger document and one counter increment per run."""

    async def handler(session: AsyncClientSession) -> dict[str, Any]:
        calls.append(key)
        await ac.db["ledger"].insert_one({"task": key, "call": len(calls)}, session=session)
        await ac.db["counters"].update_one({"_id": "charges"}, {"$inc": {"n": 1}}, session=session)
        if then is not None:
            await then(len(calls))
        return {"charged": key}

    return handler


async def complete(ac: AsyncTaskClient, key: str, run_id: str, handler: Any, **kw: Any) -> Any:
    def outcome_for(result: Any) -> Outcome:
        return Outcome(key, run_id, RunState.SUCCESS, result=result, worker_id="w")

    return await complete_transactionally(
        ac.mongo, ac._driver, handler, outcome_for, ac.clock.now, **kw
    )


async def business(ac: AsyncTaskClient) -> tuple[int, int]:
    counter = await ac.db["counters"].find_one({"_id": "charges"})
    assert counter is not None
    return int(counter["n"]), await ac.db["ledger"].count_documents({})


async def test_handler_writes_and_success_commit_together(ac: AsyncTaskClient) -> None:
    await ac.publish("charge", "c1")
    run_id = await claimed(ac, "c1", "w1")
    calls: list[str] = []
    result, doc = await complete(ac, "c1", run_id, charge(ac, "c1", calls))
    assert result == {"charged": "c1"} and doc["status"] == "succeeded"
    task = await ac.get("c1")
    assert task is not None and task.status == "succeeded" and task.result == result
    assert [r.state for r in task.runs] == ["SUCCESS"]
    assert await business(ac) == (1, 1)


async def test_an_expired_lease_aborts_the_handlers_writes(ac: AsyncTaskClient) -> None:
    await ac.publish("charge", "c1")
    run_id = await claimed(ac, "c1", "w1")
    old = dt.datetime(2020, 1, 1, tzinfo=dt.UTC)  # the lease ended, on the server's clock
    await ac.collection.update_one({"_id": "c1"}, {"$set": {"runs.0.lease_expires_at": old}})
    with pytest.raises(LeaseLost):
        await complete(ac, "c1", run_id, charge(ac, "c1", []))
    assert await business(ac) == (0, 0)
    task = await ac.get("c1")
    assert task is not None and [r.state for r in task.runs] == ["RUNNING"]


async def test_a_zombie_taken_over_mid_handler_lands_nothing(ac: AsyncTaskClient) -> None:
    """The zombie read the task (its snapshot) and wrote its business documents; then another
    worker takes the task over. The zombie's fenced SUCCESS update conflicts with the takeover
    (a write after its snapshot), its transaction aborts; the rerun finds the fence gone."""
    await ac.publish("charge", "c1")
    zombie_run = await claimed(ac, "c1", "zombie")
    taken: list[str] = []

    async def take_over(call: int) -> None:
        if call == 1:  # the lease ends; w2 claims (outside the zombie's transaction)
            old = dt.datetime(2020, 1, 1, tzinfo=dt.UTC)
            await ac.collection.update_one(
                {"_id": "c1"},
                {"$set": {"runs.0.lease_expires_at": old, "next_claim_at": old}},
            )
            taken.append(await claimed(ac, "c1", "w2"))

    zombie_calls: list[str] = []
    with pytest.raises(LeaseLost):
        await complete(ac, "c1", zombie_run, charge(ac, "c1", zombie_calls, take_over))
    assert len(zombie_calls) == 2  # the conflict made with_transaction run the body again
    assert await business(ac) == (0, 0)

    await complete(ac, "c1", taken[0], charge(ac, "c1", []))
    assert await business(ac) == (1, 1)
    task = await ac.get("c1")
    assert task is not None and task.status == "succeeded"
    assert sorted(r.state for r in task.runs) == ["SUCCESS", "TIMEOUT"]


async def test_retry_aborts_the_transaction(ac: AsyncTaskClient) -> None:
    await ac.publish("charge", "c1")
    run_id = await claimed(ac, "c1", "w1")

    async def then(call: int) -> None:
        raise Retry("card declined, later", delay=5)

    with pytest.raises(Retry):
        await complete(ac, "c1", run_id, charge(ac, "c1", [], then))
    assert await business(ac) == (0, 0)
    task = await ac.get("c1")
    assert task is not None and [r.state for r in task.runs] == ["RUNNING"]


async def test_a_handler_outliving_the_limit_fails_clearly(ac: AsyncTaskClient) -> None:
    await ac.publish("charge", "c1")
    run_id = await claimed(ac, "c1", "w1")

    async def then(call: int) -> None:
        await asyncio.Event().wait()  # never returns

    with pytest.raises(TransactionTooLong, match="more than 0.3 s"):
        await complete(ac, "c1", run_id, charge(ac, "c1", [], then), lifetime_s=0.3)
    assert await business(ac) == (0, 0)


async def dead_run_with_open_transaction(ac: AsyncTaskClient) -> tuple[Any, Doc]:
    """A run that recorded its session, wrote its business documents in its transaction and
    died (never committed, never aborted); its lease then ran out and w2 took the task over.
    Returns the dead run's session and w2's claimed document."""
    await ac.publish("charge", "c1")
    dead_run = await claimed(ac, "c1", "dead")
    dead = ac.mongo.start_session()
    begun = begin_run_transaction("c1", dead_run, "dead", await ac.now(), dead.session_id["id"])
    assert await ac._run(begun) is not None
    await dead.start_transaction()
    await ac.db["ledger"].insert_one({"task": "c1", "dead": True}, session=dead)
    await ac.db["counters"].update_one({"_id": "charges"}, {"$inc": {"n": 1}}, session=dead)
    old = dt.datetime(2020, 1, 1, tzinfo=dt.UTC)
    await ac.collection.update_one(
        {"_id": "c1"}, {"$set": {"runs.0.lease_expires_at": old, "next_claim_at": old}}
    )
    docs = await ac._run(claim(["c1"], ["charge"], "w2", await ac.now(), fields=CLAIMED_FIELDS))
    assert len(docs) == 1
    return dead, docs[0]


async def test_a_dead_runs_open_transaction_blocks_the_takeover(ac: AsyncTaskClient) -> None:
    """The control: without killing it, the dead run's transaction holds the counter, and the
    takeover's transaction meets write conflicts until the server reaps it (60 s or more)."""
    dead, doc = await dead_run_with_open_transaction(ac)
    try:
        with pytest.raises(TransactionTooLong):
            await complete(ac, "c1", doc["claim_run_id"], charge(ac, "c1", []), lifetime_s=1.5)
        assert await business(ac) == (0, 0)
    finally:
        await dead.end_session()  # aborts it


async def test_the_takeover_kills_the_dead_runs_transaction(ac: AsyncTaskClient) -> None:
    dead, doc = await dead_run_with_open_transaction(ac)
    run_id = doc["claim_run_id"]
    stale = stale_sessions(doc["runs"], run_id)
    assert stale == [dead.session_id["id"]]
    fence = RunFence("c1", run_id, "w2", tuple(stale))
    calls: list[str] = []
    async with asyncio.timeout(10):  # not the minute the server would keep it
        await complete(ac, "c1", run_id, charge(ac, "c1", calls), fence=fence)
    assert len(calls) == 1 and await business(ac) == (1, 1)  # the dead run's writes: gone
    with pytest.raises(OperationFailure) as failure:  # the dead run can no longer commit
        await dead.commit_transaction()
    assert failure.value.code == 251  # NoSuchTransaction
    task = await ac.collection.find_one({"_id": "c1"})
    assert task is not None and task["status"] == "succeeded"
    assert [r.get("txn") is not None for r in task["runs"]] == [True, True]  # both recorded
    await dead.end_session()


async def test_a_run_that_lost_its_task_starts_no_transaction(ac: AsyncTaskClient) -> None:
    await ac.publish("charge", "c1")
    run_id = await claimed(ac, "c1", "w1")
    old = dt.datetime(2020, 1, 1, tzinfo=dt.UTC)  # its lease ran out; w2 took the task over
    await ac.collection.update_one(
        {"_id": "c1"}, {"$set": {"runs.0.lease_expires_at": old, "next_claim_at": old}}
    )
    await claimed(ac, "c1", "w2")
    calls: list[str] = []
    with pytest.raises(LeaseLost):
        await complete(
            ac, "c1", run_id, charge(ac, "c1", calls), fence=RunFence("c1", run_id, "w1")
        )
    assert calls == [] and await business(ac) == (0, 0)


def test_the_fence_is_the_success_update_with_a_stronger_filter() -> None:
    outcome = Outcome("k", "r1", RunState.SUCCESS, result=1)
    now = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    filt, pipeline = complete_filter_and_pipeline(outcome, now)
    assert pipeline == finish_update(outcome, now)[1]  # the same SUCCESS as a plain run's
    assert filt["runs"] == {"$elemMatch": {"run_id": "r1", "state": "RUNNING"}}
    assert filt["status"] == "running" and "$$NOW" in str(filt["$expr"])
    with pytest.raises(ValueError, match="SUCCESS only"):
        complete_filter_and_pipeline(Outcome("k", "r1", RunState.FAIL), dt.datetime.now(dt.UTC))
