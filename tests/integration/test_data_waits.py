"""Waits on data end to end on a real replica set with real (in-process) workers
(``ctx.wait_until``; docs/triggers.md): a wait woken by the update that settles it and not by
one that does not, a wait that already holds does not wait, a timeout on the server's clock,
the plain-def forms on a thread and in a pool child, a wait on several documents, a missed
event caught by the sweep, a collection the registry does not declare, and one change stream
for a thousand waiting tasks."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from typing import Any

import datawaithandlers
from harness import count_streams, running_worker, wait_for
from pymongo import MongoClient

from mtask import AsyncTaskClient, TaskClient
from mtask.store import datawaits

Db = MongoClient[dict[str, Any]]
registry = datawaithandlers.registry


def woken(events: Any) -> int:
    return sum(e["published"] for e in events.matching("reacted", follower="wait:invoices"))


async def test_a_wait_is_woken_by_the_update_that_settles_it_and_by_no_other(
    mongo_uri: str, db_name: str, mongo: Db, aclient: AsyncTaskClient
) -> None:
    db = mongo[db_name]
    db.invoices.insert_one({"_id": "inv-1", "status": "open", "total": 40})
    async with running_worker(registry, mongo_uri, db_name) as (_, events):
        await events.wait("following", follower="wait:invoices")
        await aclient.publish("settle", "s1", {"invoice": "inv-1"})
        await events.wait("waiting", key="s1")  # told before its outcome is written: await it
        task = await wait_for(lambda: db.tasks.find_one({"_id": "s1", "status": "pending"}))
        assert task["waiting"]["data"] == {
            "collection": "invoices",
            "ids": ["inv-1"],
            "filter": {"_id": "inv-1", "status": "settled"},
        }
        argv = [sys.executable, "-m", "mtask", "get", "s1", "--uri", mongo_uri]
        got = await asyncio.to_thread(
            subprocess.run, [*argv, "--database", db_name], capture_output=True, text=True
        )
        shown = got.stdout
        assert 'invoices {"_id": "inv-1", "status": "settled"}' in shown, shown
        db.invoices.update_one({"_id": "inv-1"}, {"$set": {"status": "sent"}})  # not settled
        await wait_for(lambda: events.matching("reacted", follower="wait:invoices"))
        assert woken(events) == 0 and db.tasks.find_one({"_id": "s1"})["attempts"] == 1
        db.invoices.update_one({"_id": "inv-1"}, {"$set": {"status": "settled"}})
        await events.wait("succeeded", key="s1")
    done = await aclient.get("s1")
    assert done is not None and done.result == 40 and done.attempts == 2
    [step] = done.steps
    assert step.kind == "data" and step.state == "done" and step.collection == "invoices"
    assert done.waiting is None and woken(events) == 1


async def test_a_wait_that_already_holds_does_not_wait(
    mongo_uri: str, db_name: str, mongo: Db, aclient: AsyncTaskClient
) -> None:
    mongo[db_name].invoices.insert_one({"_id": "inv-2", "status": "settled", "total": 7})
    async with running_worker(registry, mongo_uri, db_name) as (_, events):
        await aclient.publish("settle", "s2", {"invoice": "inv-2"})
        await events.wait("succeeded", key="s2")
    done = await aclient.get("s2")
    assert done is not None and done.result == 7 and done.attempts == 1
    assert not events.matching("waiting", key="s2")


async def test_a_wait_times_out_on_the_servers_clock_and_the_handler_may_catch_it(
    mongo_uri: str, db_name: str, mongo: Db, aclient: AsyncTaskClient
) -> None:
    mongo[db_name].invoices.insert_one({"_id": "inv-3", "status": "open"})
    async with running_worker(registry, mongo_uri, db_name) as (_, events):
        await aclient.publish("settle_or_give_up", "g1", {"invoice": "inv-3", "timeout": 0.5})
        await aclient.publish("settle", "g2", {"invoice": "inv-3", "timeout": 0.5})
        await events.wait("succeeded", key="g1")
        await events.wait("failed", key="g2")
    gave_up, failed = await aclient.get("g1"), await aclient.get("g2")
    assert gave_up is not None and gave_up.result == "gave up"
    assert gave_up.steps[0].state == "timed_out"
    assert failed is not None and failed.status.value == "failed"
    assert "ConditionTimeout" in (failed.error or "")


async def test_plain_def_handlers_wait_on_a_thread_and_in_a_pool_child(
    mongo_uri: str, db_name: str, mongo: Db, aclient: AsyncTaskClient
) -> None:
    db = mongo[db_name]
    db.invoices.insert_many(
        [{"_id": "t", "status": "open", "total": 1}, {"_id": "c", "status": "open", "total": 2}]
    )
    async with running_worker(registry, mongo_uri, db_name) as (_, events):
        await events.wait("following", follower="wait:invoices")
        await aclient.publish("settle_in_thread", "p1", {"invoice": "t"})
        await aclient.publish("settle_in_child", "p2", {"invoice": "c"})
        await events.wait("waiting", key="p1")
        await events.wait("waiting", key="p2", timeout=60)
        db.invoices.update_many({}, {"$set": {"status": "settled"}})
        await events.wait("succeeded", key="p1")
        await events.wait("succeeded", key="p2", timeout=60)
    assert [(await aclient.get(k)).result for k in ("p1", "p2")] == [1, 2]  # type: ignore[union-attr]


async def test_a_wait_on_several_documents_is_woken_by_any_that_settles(
    mongo_uri: str, db_name: str, mongo: Db, aclient: AsyncTaskClient
) -> None:
    db = mongo[db_name]
    db.invoices.insert_many([{"_id": i, "status": "open"} for i in range(5)])
    async with running_worker(registry, mongo_uri, db_name) as (_, events):
        await events.wait("following", follower="wait:invoices")
        await aclient.publish("any_settled", "a1", {"invoices": [1, 3]})
        await events.wait("waiting", key="a1")
        db.invoices.update_one({"_id": 2}, {"$set": {"status": "settled"}})  # not one of its
        db.invoices.update_one({"_id": 3}, {"$set": {"status": "settled"}})
        await events.wait("succeeded", key="a1")
    done = await aclient.get("a1")
    assert done is not None and done.result == 3


async def test_a_missed_event_only_delays_the_wake_up_the_sweep_finds_it(
    mongo_uri: str, db_name: str, mongo: Db, aclient: AsyncTaskClient, client: TaskClient
) -> None:
    db = mongo[db_name]
    db.invoices.insert_one({"_id": "inv-4", "status": "open", "total": 4})
    async with running_worker(registry, mongo_uri, db_name, sweep_interval=1.0) as (_, events):
        await events.wait("following", follower="wait:invoices")
        await aclient.publish("settle", "m1", {"invoice": "inv-4"})
        await events.wait("waiting", key="m1")
        client.pause_trigger("wait:invoices")
        await events.wait("unfollowed", follower="wait:invoices")
        db.invoices.update_one({"_id": "inv-4"}, {"$set": {"status": "settled"}})
        client.reset_trigger("wait:invoices")  # its position forgotten: the change is missed
        client.resume_trigger("wait:invoices")
        await events.wait("succeeded", key="m1", timeout=30)
    assert not [e for e in events.matching("reacted", follower="wait:invoices") if e["published"]]


async def test_a_wait_on_a_collection_the_registry_does_not_declare_fails_saying_so(
    mongo_uri: str, db_name: str, aclient: AsyncTaskClient
) -> None:
    async with running_worker(registry, mongo_uri, db_name) as (_, events):
        await aclient.publish("undeclared", "u1")
        await events.wait("failed", key="u1")
    task = await aclient.get("u1")
    assert task is not None and task.status.value == "failed"
    assert "registry.waits_on('payments')" in (task.error or "")


async def test_a_thousand_waiting_tasks_cost_one_change_stream(
    mongo_uri: str, db_name: str, mongo: Db, aclient: AsyncTaskClient
) -> None:
    n = 1000
    db = mongo[db_name]
    db.invoices.insert_many([{"_id": i, "status": "open", "total": i} for i in range(n)])
    async with (
        running_worker(registry, mongo_uri, db_name, concurrency=64) as (_, events),
        running_worker(registry, mongo_uri, db_name, concurrency=64) as (_, other),
    ):
        following = {"follower": "wait:invoices"}
        await wait_for(
            lambda: (
                events.matching("following", **following)
                or other.matching("following", **following)
            )
        )
        await aclient.publish_many(
            {"name": "settle", "key": f"k{i}", "params": {"invoice": i}} for i in range(n)
        )
        waiting = {"status": "pending", "waiting.data.collection": "invoices"}
        await wait_for(lambda: db.tasks.count_documents(waiting) == n, timeout=240)
        assert count_streams(mongo, db_name, "invoices") == 1
        plan = db.tasks.find(
            {"waiting.data.collection": "invoices", "waiting.data.ids": {"$in": [5]}}
        ).explain()
        assert datawaits.INDEX_NAME in str(plan["queryPlanner"]["winningPlan"])
        for start in range(0, n, 100):
            db.invoices.update_many(
                {"_id": {"$gte": start, "$lt": start + 100}}, {"$set": {"status": "settled"}}
            )
        done = {"name": "settle", "status": "succeeded"}
        await wait_for(lambda: db.tasks.count_documents(done) == n, timeout=240)
        assert count_streams(mongo, db_name, "invoices") == 1
    followers = [e for e in (events, other) if e.matching("following", follower="wait:invoices")]
    assert len(followers) == 1  # one of the two workers follows it for the cluster
    assert woken(events) + woken(other) == n  # each by the change that settled it
    results = {d["_id"]: d["result"] for d in db.tasks.find({"name": "settle"}, {"result": 1})}
    assert results == {f"k{i}": i for i in range(n)}
