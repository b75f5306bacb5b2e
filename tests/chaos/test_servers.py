"""MongoDB itself in trouble: restarted under load, its primary stepped down, the change
stream's cursor killed on the server."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import pytest
from harness import (
    Cluster,
    change_streams,
    kill_change_streams,
    replica_set_with_workers,
    until_finished,
    wait_for,
)
from pymongo import MongoClient
from sizes import Size
from test_kills import assert_invariants, work_items

from mtask import TaskClient
from mtask.embedded import EmbeddedMongo

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(1800)]

LEASE = {"worker_timeout_ms": 5000, "ping_interval_ms": 500}


def two_workers(cluster: Cluster) -> None:
    for name in ("a", "b"):
        cluster.spawn(name, "--concurrency", "8", "--sweep-interval", "2")


async def test_mongodb_restarted_under_load(tmp_path: Path, db_name: str, size: Size) -> None:
    server = EmbeddedMongo(tmp_path / "mongodb")
    uri = server.start()
    cluster = Cluster(uri, db_name, tmp_path)
    try:
        with TaskClient(uri, database=db_name) as client:
            items = work_items(size.tasks, seed=2, **LEASE)
            two_workers(cluster)
            client.publish_many(items)
            for _ in range(size.restarts):
                await asyncio.sleep(1.5)
                await asyncio.to_thread(server.stop)
                await asyncio.sleep(1.0)
                assert await asyncio.to_thread(server.start) == uri
            try:
                await until_finished(
                    client,
                    len(items),
                    timeout=120 + size.tasks / 5,
                    explain=cluster.explainer(client),
                )
            except AssertionError:
                for doc in client.collection.find({"status": "pending"}, {"params": 0}).limit(3):
                    print("STUCK", doc)
                for name in ("a", "b"):
                    print(name, cluster.procs[name].poll(), cluster.log_of(name)[-3000:])
                print(client.now())
                raise
            with MongoClient(uri, tz_aware=True) as mongo:
                report = assert_invariants(mongo, db_name, {i["key"] for i in items})
            assert report.by_status["succeeded"] == len(items)
            assert all(proc.poll() is None for proc in cluster.procs.values())  # rode it out
    finally:
        cluster.close()
        server.stop()


async def test_primary_stepped_down_mid_run(tmp_path: Path, db_name: str, size: Size) -> None:
    replica_set, cluster = await replica_set_with_workers(tmp_path, db_name)
    uri = cluster.uri
    try:
        with TaskClient(uri, database=db_name) as client:
            items = work_items(size.tasks, seed=3, **LEASE)
            two_workers(cluster)
            half = len(items) // 2
            client.publish_many(items[:half])
            failovers = []
            for i in range(size.failovers):
                await asyncio.sleep(1.5)
                failovers.append(await asyncio.to_thread(replica_set.step_down))
                if i == 0:  # publishing goes on across the failover
                    client.publish_many(items[half:])
            if not failovers:
                client.publish_many(items[half:])
            await until_finished(
                client, len(items), timeout=120 + size.tasks / 5, explain=cluster.explainer(client)
            )
            with MongoClient(uri, tz_aware=True) as mongo:
                report = assert_invariants(mongo, db_name, {i["key"] for i in items})
            assert report.by_status["succeeded"] == len(items)
            assert all(old != new for old, new in failovers) and len(failovers) == size.failovers
            assert all(proc.poll() is None for proc in cluster.procs.values())
    finally:
        cluster.close()
        replica_set.stop()


@pytest.mark.parametrize("stream", ["own", "shared"])
async def test_change_stream_cursors_killed(  # noqa: C901 - one scenario, its waits in order
    cluster: Cluster, client: TaskClient, mongo: Any, db_name: str, size: Size, stream: str
) -> None:
    rng = random.Random(5)
    for name in ("a", "b"):
        cluster.spawn(name, "--concurrency", "8", "--sweep-interval", "2", "--stream", stream)
    await _until_workers(client, 2)
    items = work_items(size.tasks // 3, seed=4, worker_timeout_ms=3000, ping_interval_ms=300)
    kills = 0
    for n, item in enumerate(items):  # one by one, so that the stream is what finds them
        client.publish(item["name"], item["key"], item["params"], options=item["options"])
        if n % max(1, len(items) // size.stream_kills) == 0:
            kills += kill_change_streams(mongo, db_name)
        await asyncio.sleep(rng.uniform(0, 0.02))
    try:
        await until_finished(client, len(items), timeout=120, explain=cluster.explainer(client))
    except AssertionError:
        for name in ("a", "b"):
            print(name, cluster.procs[name].poll(), cluster.log_of(name)[-3000:])
        raise
    report = assert_invariants(mongo, db_name, {i["key"] for i in items})
    assert report.by_status["succeeded"] == len(items)
    assert kills >= size.stream_kills
    # Rode it out: a reopened stream's rescan that met the sweep's once stopped a worker.
    assert all(proc.poll() is None for proc in cluster.procs.values())

    # Both workers' streams (own) or the host's one (shared) are open again: pymongo resumes
    # a killed idle cursor by itself, the watcher (or the relay) reopens a stream whose waiting
    # getMore was killed (and logs it). Which of the two a kill meets depends on timing, so no
    # particular log line is required.
    def open_streams() -> set[Any]:
        return {op.get("cursor", {}).get("cursorId") for op in change_streams(mongo, db_name)}

    await wait_for(lambda: len(open_streams() - {None}) >= (2 if stream == "own" else 1))
    # and each worker still runs new tasks: one only it may run
    for name in ("a", "b"):  # (concurrency 1: a task of concurrency 2 needs two workers)
        client.publish("work", f"after-{name}", {"ms": 50}, options={"specific_worker_ids": [name]})
    try:
        await until_finished(client, len(items) + 2, timeout=60, explain=cluster.explainer(client))
    except AssertionError:
        for doc in client.collection.find({"_id": {"$in": ["after-a", "after-b"]}}):
            print("OPEN", doc)
        for name in ("a", "b"):
            print(name, cluster.procs[name].poll(), cluster.log_of(name)[-3000:])
        raise


async def _until_workers(client: TaskClient, count: int) -> None:
    for _ in range(600):
        if len(client.workers()) >= count:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the workers did not start")
