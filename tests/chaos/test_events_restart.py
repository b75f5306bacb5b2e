"""Waiting and events across a MongoDB restart: the waiter's and the events' change
streams resume with their tokens once the server is back; nothing missed, nothing twice."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from harness import running_worker, wait_for
from workerapp import registry

from mtask import AsyncTaskClient, TaskClient
from mtask.embedded import EmbeddedMongo
from mtask.follow.events import TaskEvent, events

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(600)]


async def consume(stream: AsyncIterator[TaskEvent], into: list[TaskEvent]) -> None:
    async for event in stream:
        into.append(event)


async def test_wait_and_events_ride_out_a_mongodb_restart(tmp_path: Path, db_name: str) -> None:
    server = EmbeddedMongo(tmp_path / "mongodb")
    uri = server.start()
    try:
        async with AsyncTaskClient(uri, database=db_name) as aclient:
            with TaskClient(uri, database=db_name) as client:
                keys = [f"r{i}" for i in range(10)]
                for key in keys[:5]:
                    client.publish("add", key, {"a": 1, "b": 1})
                seen: list[TaskEvent] = []
                opened = asyncio.Event()
                stream = events(
                    aclient.collection, names=["add"], statuses=["succeeded"], opened=opened
                )
                consumer = asyncio.create_task(consume(stream, seen))
                await opened.wait()
                waits = [asyncio.create_task(aclient.wait(k, timeout=300)) for k in keys[:5]]
                await wait_for(
                    lambda: aclient._waiter is not None and len(aclient._waiter.waiting) == 5
                )
                await asyncio.to_thread(server.stop)
                assert await asyncio.to_thread(server.start) == uri
                for key in keys[5:]:
                    client.publish("add", key, {"a": 1, "b": 1})
                    waits.append(asyncio.create_task(aclient.wait(key, timeout=300)))
                async with running_worker(registry, uri, db_name, concurrency=4):
                    finished = await asyncio.gather(*waits)
                    await wait_for(lambda: {e.key for e in seen} == set(keys), timeout=120)
                consumer.cancel()
                assert all(t.status == "succeeded" for t in finished)
                assert sorted(e.key for e in seen) == sorted(keys)  # each once
                # (pymongo resumes a change stream with its token by itself after the restart;
                # the waiter reopens and re-reads only when that fails)
    finally:
        server.stop()
