"""A zombie's writes of a parallel step and of a data wait, refused by the real server: a run
whose lease ran out (its ``lease_expires_at`` set in the past, no sleeping) writes nothing,
neither before another worker takes its task over nor after; the run that took it over writes.
A wake is fenced by the wait it read: a task that moved on to another wait is not woken by it."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from pymongo import MongoClient

from mtask import TaskClient
from mtask.errors import LeaseLost
from mtask.store import claim, datawaits
from mtask.store import steps as store_steps

LONG_AGO = dt.datetime(2001, 1, 1, tzinfo=dt.UTC)


def claimed(client: TaskClient, key: str, worker: str) -> str:
    [doc] = client._run(claim([key], ["n"], worker, client.now()))
    return str(doc["claim_run_id"])


def expire(db: Any, key: str) -> None:
    """The lease of the task's only run ends long ago, on the server's clock as on any."""
    db.tasks.update_one(
        {"_id": key}, {"$set": {"runs.0.lease_expires_at": LONG_AGO, "next_claim_at": LONG_AGO}}
    )


@pytest.fixture
def db(mongo: MongoClient[dict[str, Any]], db_name: str) -> Any:
    return mongo[db_name]


def test_a_zombies_parallel_step_is_refused_and_the_takeovers_is_recorded(
    client: TaskClient, db: Any
) -> None:
    client.publish("n", "k")
    zombie = claimed(client, "k", "w1")
    entry = {"name": "a", "kind": "call", "state": "done", "group": "gather#1", "result": 1}
    expire(db, "k")
    with pytest.raises(LeaseLost):  # its lease ran out: nobody took the task yet
        client._run(store_steps.record_named("k", zombie, entry, None))
    rescuer = claimed(client, "k", "w2")
    assert rescuer != zombie
    with pytest.raises(LeaseLost):  # taken over
        client._run(store_steps.record_named("k", zombie, entry, None))
    assert db.tasks.find_one({"_id": "k"}).get("steps", []) == []
    client._run(store_steps.record_named("k", rescuer, {**entry, "result": 2}, None))
    [step] = db.tasks.find_one({"_id": "k"})["steps"]
    assert step["name"] == "a" and step["result"] == 2
    # the zombie cannot overwrite the rescuer's record in place either
    with pytest.raises(LeaseLost):
        client._run(store_steps.record_named("k", zombie, {**entry, "result": 3}, step))
    assert db.tasks.find_one({"_id": "k"})["steps"][0]["result"] == 2


def data_wait(index: int, ids: list[Any]) -> dict[str, Any]:
    return {
        "index": index,
        "step": f"wait#{index}",
        "data": {"collection": "orders", "ids": ids, "filter": {"_id": {"$in": ids}}},
    }


def test_a_zombies_data_wait_is_refused_and_a_stale_wake_wakes_nothing(
    client: TaskClient, db: Any
) -> None:
    client._run(datawaits.ensure_index())
    client.publish("n", "k")
    zombie = claimed(client, "k", "w1")
    expire(db, "k")
    with pytest.raises(LeaseLost):  # its lease ran out: nobody took the task yet
        client._run(datawaits.announce("k", zombie, data_wait(0, ["o1"])))
    rescuer = claimed(client, "k", "w2")
    with pytest.raises(LeaseLost):  # taken over
        client._run(datawaits.announce("k", zombie, data_wait(0, ["o1"])))
    assert "waiting" not in db.tasks.find_one({"_id": "k"})
    assert client._run(datawaits.waiting_on("orders", ["o1"])) == []
    # the rescuer's wait is announced; a change finds it and wakes it once
    client._run(datawaits.announce("k", rescuer, data_wait(1, ["o2"])))
    [read] = client._run(datawaits.waiting_on("orders", ["o2"]))
    assert read["waiting"]["index"] == 1
    # a wake read for an earlier wait of the task (index 0) does not wake this one
    stale = {"_id": "k", "waiting": {**read["waiting"], "index": 0}}
    assert client._run(datawaits.wake([stale])) == 0
    assert "woke" not in db.tasks.find_one({"_id": "k"})["waiting"]["data"]
    assert client._run(datawaits.wake([read])) == 1
    assert "woke" in db.tasks.find_one({"_id": "k"})["waiting"]["data"]
    assert client._run(datawaits.wake([read])) == 0  # woken already: not written again
