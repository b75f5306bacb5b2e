"""Fairness between groups and places in line, with real workers on the real
replica set, asserted from the task documents' run arrays."""

from __future__ import annotations

import contextlib
import datetime as dt
from typing import Any

import pytest
import workerapp
from harness import running_worker, wait_for
from pymongo import MongoClient

from mtask import TaskClient, store
from mtask.driver import SyncDriver

SLEEP_10MS = {"seconds": 0.01}


def finished(db: Any, prefix: str) -> list[dt.datetime]:
    """When each succeeded task whose key starts with ``prefix`` finished (its run's end)."""
    docs = db.tasks.find(
        {"_id": {"$regex": f"^{prefix}"}, "status": "succeeded"}, {"runs.finished_at": 1}
    )
    return sorted(d["runs"][-1]["finished_at"] for d in docs)


def publish(client: TaskClient, prefix: str, n: int, group: str | None) -> None:
    options = {} if group is None else {"group": group}
    client.publish_many(
        [
            {"name": "sleep", "key": f"{prefix}{i:05d}", "params": SLEEP_10MS, "options": options}
            for i in range(n)
        ]
    )


async def b_behind_a(
    mongo_uri: str,
    db: Any,
    client: TaskClient,
    a: int,
    grouped: bool,
    stream: str = "shared",
    workers: int = 1,
) -> tuple[int, int]:
    """``a`` tasks of A, then 40 of B once A is under way (``workers`` at concurrency 4 in
    all, finding work with ``stream``): how many of A finished between B's publish and B's
    last success, and how many of A were left unfinished at B's publish."""
    publish(client, "a/", a, "A" if grouped else None)
    async with contextlib.AsyncExitStack() as stack:
        for _ in range(workers):
            await stack.enter_async_context(
                running_worker(
                    workerapp.registry,
                    mongo_uri,
                    db.name,
                    concurrency=4 // workers,
                    stream=stream,
                )
            )
        await wait_for(lambda: len(finished(db, "a/")) >= 40)
        before = len(finished(db, "a/"))
        publish(client, "b/", 40, "B" if grouped else None)
        published = db.tasks.find_one({"_id": "b/00000"})["created_at"]
        await wait_for(lambda: len(finished(db, "b/")) == 40, timeout=120)
        last_b = finished(db, "b/")[-1]
    a_meanwhile = [t for t in finished(db, "a/") if published < t <= last_b]
    return len(a_meanwhile), a - before


@pytest.mark.parametrize(("stream", "workers"), [("shared", 1), ("own", 1), ("own", 2)])
async def test_a_groups_backlog_does_not_starve_another_group(
    mongo_uri: str,
    mongo: MongoClient[Any],
    db_name: str,
    client: TaskClient,
    stream: str,
    workers: int,
) -> None:
    """2,000 tasks of group A, then 40 of group B, concurrency 4 in all, handlers of 10 ms:
    all of B's tasks finish before A has finished 120 more — with the relay's queue, with a
    worker's own stream, and with two workers each finding its own work."""
    db = mongo[db_name]
    meanwhile, _ = await b_behind_a(
        mongo_uri, db, client, 2000, grouped=True, stream=stream, workers=workers
    )
    assert meanwhile < 120


async def test_without_groups_the_later_tasks_wait_for_the_backlog(
    mongo_uri: str, mongo: MongoClient[Any], db_name: str, client: TaskClient
) -> None:
    """The same without groups (a smaller backlog): B waits for nearly all of A, in line."""
    meanwhile, left = await b_behind_a(mongo_uri, mongo[db_name], client, 400, grouped=False)
    assert meanwhile >= left - 8  # all of A but those running beside B's first ones


@pytest.mark.parametrize("workers", [1, 2])
async def test_a_task_whose_lease_ran_out_keeps_its_place(
    mongo_uri: str, mongo: MongoClient[Any], db_name: str, client: TaskClient, workers: int
) -> None:
    """A task whose worker died is claimed ahead of tasks published after it, though its
    lease ended after they became due (one worker finding its own work; two: the relay's
    queue for both)."""
    db = mongo[db_name]
    client.publish("sleep", "taken-over", SLEEP_10MS)
    driver = SyncDriver(db)
    now = client.clock.now()
    claimed = driver.run(store.claim(["taken-over"], ["sleep"], "dead-worker", now))
    assert claimed
    publish(client, "later/", 30, None)
    # the dead worker's lease ends after every later task became due, and before now
    later = db.tasks.find_one({"_id": "later/00029"})["available_at"]
    lease_end = later + dt.timedelta(milliseconds=5)
    db.tasks.update_one(
        {"_id": "taken-over"},
        {"$set": {"runs.0.lease_expires_at": lease_end, "next_claim_at": lease_end}},
    )
    await wait_for(lambda: client.clock.now() > lease_end + dt.timedelta(milliseconds=50))
    async with running_worker(workerapp.registry, mongo_uri, db_name, concurrency=1) as first:
        if workers == 2:
            async with running_worker(workerapp.registry, mongo_uri, db_name, concurrency=1):
                await wait_for(lambda: len(finished(db, "")) == 31, timeout=60)
        else:
            await wait_for(lambda: len(finished(db, "")) == 31, timeout=60)
        assert first
    # each worker runs one at a time: the order they end in is the order they took a slot in
    # (runs claimed ahead in one batch share their claimed_at)
    ends = sorted((d["runs"][-1]["finished_at"], d["_id"]) for d in db.tasks.find())
    assert "taken-over" in [key for _, key in ends[:workers]]
    doc = db.tasks.find_one({"_id": "taken-over"})
    assert [r["state"] for r in doc["runs"]] == ["TIMEOUT", "SUCCESS"]


@pytest.mark.parametrize(("aging", "first"), [(None, "fresh-high"), (60.0, "old-low")])
async def test_priority_aging_lets_long_waiting_work_go_first(
    mongo_uri: str,
    mongo: MongoClient[Any],
    db_name: str,
    client: TaskClient,
    aging: float | None,
    first: str,
) -> None:
    """A priority-0 task due ten minutes ago against a fresh priority-5 one: with
    ``priority_aging=60`` (one level a minute) the old one has risen to 10 and goes first;
    with strict priorities the fresh one does."""
    now = client.now()
    client.publish(
        "sleep", "old-low", SLEEP_10MS, options={"run_at": now - dt.timedelta(minutes=10)}
    )
    client.publish("sleep", "fresh-high", SLEEP_10MS, options={"priority": 5})
    async with running_worker(
        workerapp.registry, mongo_uri, db_name, concurrency=1, priority_aging=aging
    ):
        await wait_for(lambda: len(finished(mongo[db_name], "")) == 2)
    # one at a time: the first to take the slot ends first (claimed ahead, both may share a
    # claimed_at)
    ends = sorted((d["runs"][-1]["finished_at"], d["_id"]) for d in mongo[db_name].tasks.find())
    assert ends[0][1] == first
