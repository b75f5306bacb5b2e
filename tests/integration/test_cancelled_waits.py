"""Operations cancelled while MongoDB is down leave the client working: pymongo's condition
waits on Python 3.11 could leave the client's lock held for good (``mtask.connection.lock_waits``),
after which no operation ever ended, with no error."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

from harness.replicaset import ReplicaSet
from pymongo import AsyncMongoClient

from mtask.connection.clients import WORKER_CLIENT_OPTIONS, async_client

OPERATIONS = 300


async def operation(client: AsyncMongoClient[dict[str, Any]], kind: int) -> None:
    collection = client.t.c
    if kind == 0:
        await collection.find_one({})
    elif kind == 1:
        await collection.insert_one({"x": 1})
    else:
        await collection.update_one({"_id": 1}, {"$set": {"a": 1}}, upsert=True)


async def test_operations_cancelled_while_mongodb_is_down_leave_the_client_working(
    tmp_path: Path,
) -> None:
    """A worker cancels operations that wait for a server: a side service at its stop, a run
    stopped as lost, a caller's timeout. Here hundreds wait for a replica set killed whole and
    are cancelled at random moments (some twice): each one ends, and the same client works once
    the set is back. Without the workaround, on Python 3.11, some never ended and the client's
    next operation waited for ever."""
    replica_set = ReplicaSet(tmp_path / "rs", members=1)
    uri = await asyncio.to_thread(replica_set.start)
    client = async_client(uri, defaults=WORKER_CLIENT_OPTIONS)
    try:
        await client.t.c.insert_one({"_id": "seen"})
        await asyncio.to_thread(replica_set.kill_all)
        rng = random.Random(2)
        tasks: list[asyncio.Task[None]] = []
        for _ in range(OPERATIONS):
            tasks.append(asyncio.create_task(operation(client, rng.randrange(3))))
            await asyncio.sleep(rng.uniform(0, 0.02))
            for task in rng.sample(tasks, min(len(tasks), 3)):
                task.cancel()
                if rng.random() < 0.3:  # cancelled again, as a stop after a timeout does
                    await asyncio.sleep(0)
                    task.cancel()
        for task in tasks:
            task.cancel()
        # a hang guard, not a measure: a cancel whose wait swallowed it still ends at the
        # client's server selection timeout (10 s)
        _, stuck = await asyncio.wait(tasks, timeout=60)
        assert not stuck, f"{len(stuck)} of {OPERATIONS} cancelled operations never ended"
        await asyncio.to_thread(replica_set.restart_all)
        found = await asyncio.wait_for(client.t.c.find_one({"_id": "seen"}), 60)
        assert found == {"_id": "seen"}
    finally:
        await client.close()
        await asyncio.to_thread(replica_set.stop)
