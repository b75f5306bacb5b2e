"""What triggers and waits on data cost a worker that declares none: nothing. No
follower loop, no read of ``triggers``, no change stream beyond the worker's own, no index key
(the ``data_waits`` index is not even made). A worker that declares one trigger adds exactly
one change stream, whatever the number of workers (tests/integration/test_cost.py pins the
operations of a plain worker's task; ``bench`` WT measures the idle cost)."""

from __future__ import annotations

from typing import Any

from harness import count_streams, running_worker, wait_for
from pymongo import MongoClient

from mtask import AsyncTaskClient
from mtask.registry import Registry
from mtask.store import datawaits

Db = MongoClient[dict[str, Any]]


def _registry(triggers: bool) -> Registry:
    registry = Registry()

    @registry.task("plain")
    async def plain(params: dict[str, Any]) -> int:
        return 1

    if triggers:
        registry.trigger("orders", task="plain", match={"status": "paid"})
    return registry


async def test_a_worker_without_triggers_or_waits_pays_nothing_for_them(
    mongo_uri: str, db_name: str, mongo: Db, aclient: AsyncTaskClient
) -> None:
    db = mongo[db_name]
    async with running_worker(_registry(False), mongo_uri, db_name) as (worker, events):
        await aclient.publish("plain", "p1")
        await events.wait("succeeded", key="p1")
        own = await wait_for(lambda: count_streams(mongo, db_name))
        db.orders.insert_one({"_id": 1, "status": "paid"})
        assert not [s for s in worker.parts.services if s.name == "followers"]
        assert count_streams(mongo, db_name) == own
    assert "triggers" not in db.list_collection_names()
    assert datawaits.INDEX_NAME not in db.tasks.index_information()
    assert not events.matching("following") and db.tasks.count_documents({}) == 1


async def test_one_trigger_adds_one_change_stream_for_the_whole_cluster(
    mongo_uri: str, db_name: str, mongo: Db
) -> None:
    async with running_worker(_registry(False), mongo_uri, db_name) as _:
        plain = await wait_for(lambda: count_streams(mongo, db_name))
    async with (
        running_worker(_registry(True), mongo_uri, db_name) as (_, one),
        running_worker(_registry(True), mongo_uri, db_name) as (_, two),
        running_worker(_registry(True), mongo_uri, db_name) as (_, three),
    ):
        await wait_for(lambda: any(e.matching("following") for e in (one, two, three)))
        streams = await wait_for(lambda: count_streams(mongo, db_name) == plain + 1 or None)
        assert streams
        assert sum(len(e.matching("following")) for e in (one, two, three)) == 1
