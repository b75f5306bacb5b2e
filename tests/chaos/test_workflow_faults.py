"""Issue 61's workflows with real worker processes on a real three-member replica set: a parent
spawns 1,000 children and awaits them, each worker at concurrency 1; a worker is killed with
kill -9 mid-way and the primary once. Nothing blocks the worker while the parent waits, each
child's effect lands once (it commits with its step), the parent gets every result in order.
And parallel steps: a worker killed after two of three ended; on takeover only the third runs.
(The 10,000-child fan-out is bench WC's; here the moderate size.)"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import Cluster, ReplicaSet, wait_for
from pymongo import MongoClient
from workflowchaos import LEASE

from mtask import TaskClient

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(900)]
CHILDREN = 1000


@contextlib.contextmanager
def workers(uri: str, database: str, logs: Path) -> Iterator[Cluster]:
    """``mtask-worker`` processes of ``workflowchaos:registry``."""
    found = Cluster(uri, database, logs, app="workflowchaos:registry")
    try:
        yield found
    finally:
        found.close()


def _count(mongo: MongoClient[dict[str, Any]], db: str, collection: str, **match: Any) -> int:
    try:
        return mongo[db][collection].count_documents(match)
    except Exception:  # noqa: BLE001 - failing over: ask again
        return -1


async def test_a_thousand_children_awaited_across_a_kill_and_a_failover(
    tmp_path: Path, db_name: str
) -> None:
    replica_set = ReplicaSet(tmp_path / "rs")
    uri = await asyncio.to_thread(replica_set.start)
    try:
        with (
            MongoClient(uri, tz_aware=True) as mongo,
            TaskClient(uri, database=db_name) as client,
            workers(uri, db_name, tmp_path) as cluster,
        ):
            sweep = ("--concurrency", "1", "--sweep-interval", "1")
            cluster.spawn("w1", *sweep)
            cluster.spawn("w2", *sweep)
            client.publish("fan_parent", "fan", {"n": CHILDREN}, options=LEASE)

            def effects() -> int:
                return _count(mongo, db_name, "effects")

            await wait_for(lambda: effects() >= CHILDREN // 3, timeout=300, every=0.2)
            await asyncio.to_thread(cluster.signal, "w1", signal.SIGKILL)  # kill -9, mid-way
            cluster.spawn("w3", *sweep)
            await wait_for(lambda: effects() >= 2 * CHILDREN // 3, timeout=300, every=0.2)
            primary = await asyncio.to_thread(replica_set.wait_primary)
            os.kill(replica_set.pids.pop(primary), signal.SIGKILL)  # the primary, killed
            await asyncio.to_thread(replica_set.wait_primary, 60, primary)
            await asyncio.to_thread(replica_set._launch, primary)  # it comes back as a member

            async def finished() -> bool:
                try:
                    task = await asyncio.to_thread(client.get, "fan")
                except Exception:  # noqa: BLE001 - failing over: ask again
                    return False
                return task is not None and task.status is not None and task.status.finished

            await wait_for(finished, timeout=600, every=0.5)
            task = client.get("fan")
            assert task is not None and task.status is not None
            assert task.status.value == "succeeded", (task.error, task.spawned)
            assert task.result == [n * 3 for n in range(CHILDREN)]  # every result, in order
            assert effects() == CHILDREN  # each child's effect once
            keys = mongo[db_name]["effects"].distinct("key")
            assert len(keys) == CHILDREN
            states = [r.state.value for r in task.runs]
            assert states[0] == "WAITING" and states[-1] == "SUCCESS"
            # the worker that ran the parent ran children while it waited: not blocked
            parent_worker = task.runs[0].worker_id
            ran = mongo[db_name]["effects"].count_documents({"worker": parent_worker})
            assert ran > 0, parent_worker
            # each child counted once on its parent; a count lost to the kill or the failover
            # (its worker died after the child's outcome, or the primary refused the count) is
            # the sweep's to find: it counted the children itself and woke the parent
            spawned = task.spawned
            assert spawned is not None and spawned.done <= CHILDREN
            assert spawned.done == CHILDREN or spawned.checked_at is not None, spawned.done
            assert (
                mongo[db_name]["tasks"].count_documents({"parent": "fan", "status": "succeeded"})
                == CHILDREN
            )
    finally:
        replica_set.stop()


async def test_parallel_steps_after_a_kill_run_only_the_one_not_recorded(
    mongo_uri: str, db_name: str, tmp_path: Path
) -> None:
    with (
        MongoClient(mongo_uri, tz_aware=True) as mongo,
        TaskClient(mongo_uri, database=db_name) as client,
        workers(mongo_uri, db_name, tmp_path) as cluster,
    ):
        cluster.spawn("w1", "--sweep-interval", "1")
        client.publish("three", "t3", {}, options=LEASE)
        tasks = mongo[db_name]["tasks"]

        def two_ended() -> bool:
            doc = tasks.find_one({"_id": "t3"}, {"steps": 1}) or {}
            done = [s["name"] for s in doc.get("steps", []) if s.get("state") == "done"]
            return sorted(done) == ["a", "b"] and _count(mongo, db_name, "calls", step="c") == 1

        await wait_for(two_ended, timeout=60)
        await asyncio.to_thread(cluster.signal, "w1", signal.SIGKILL)
        mongo[db_name]["release"].insert_one({"_id": "t3"})
        cluster.spawn("w2", "--sweep-interval", "1")
        await wait_for(
            lambda: (client.get("t3") or None) is not None and client.get("t3").status.finished,  # type: ignore[union-attr]
            timeout=60,
        )
        task = client.get("t3")
        calls = {s: _count(mongo, db_name, "calls", step=s) for s in "abc"}
    assert task is not None and task.result == ["A", "B", "C"]
    assert calls == {"a": 1, "b": 1, "c": 2}  # the killed run's c, and the takeover's
    assert {s.name for s in task.steps} == {"a", "b", "c"}
    assert {s.group for s in task.steps} == {"gather#1"}
    assert len(task.runs) == 2 and task.runs[-1].worker_id == "w2"
