"""``prefetch``: runs claimed ahead of a free slot wait for one (their lease pinged), start when
a slot frees, and are given back at once when the worker stops."""

from __future__ import annotations

import poolhandlers
import pytest
from harness import running_worker, wait_for

from mtask import TaskClient
from mtask.errors import ConfigError
from mtask.worker import Worker


async def test_a_prefetched_run_waits_for_the_slot(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    async with running_worker(
        poolhandlers.registry, mongo_uri, db_name, concurrency=1, prefetch=1
    ) as (worker, events):
        client.publish("cooperative", "first", options={"ping_interval_ms": 100})
        await events.wait("claimed", key="first")
        pool = worker.parts.process_pool
        assert pool is not None
        await wait_for(lambda: pool.state()["busy"] == 1)
        client.publish("double", "second", {"n": 2})
        await events.wait("claimed", key="second")
        # claimed and in flight, but the one slot is taken: its handler has not started
        assert worker.in_flight == 2 and pool.state()["busy"] == 1
        assert not events.matching("recorded", key="second")
        client.cancel("first")
        await events.wait("recorded", key="first", state="CANCELLED")
        await events.wait("recorded", key="second")
    second = client.get("second")
    assert second is not None and second.status == "succeeded" and second.result["value"] == 4


async def test_a_stopping_worker_gives_back_what_it_prefetched(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    async with running_worker(
        poolhandlers.registry, mongo_uri, db_name, concurrency=1, prefetch=1, grace=30
    ) as (worker, events):
        client.publish("cooperative", "running")
        await events.wait("claimed", key="running")
        client.publish("double", "waiting", {"n": 1})
        await events.wait("claimed", key="waiting")
        worker.stop()  # not immediate: the running one may finish within its grace
        await events.wait("released", key="waiting")
        assert not events.matching("released", key="running")
        await events.wait("recorded", key="waiting", state="RELEASED")
        worker.stop(immediate=True)
        await events.wait("recorded", key="running", state="RELEASED")
    waiting = client.get("waiting")
    assert waiting is not None and waiting.status == "pending" and waiting.attempts == 1


def test_prefetch_must_not_be_negative() -> None:
    with pytest.raises(ConfigError) as caught:
        Worker(poolhandlers.registry, prefetch=-1)
    assert caught.value.field == "prefetch"
