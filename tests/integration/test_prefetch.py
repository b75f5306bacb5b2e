"""``prefetch``: runs claimed ahead of a free slot wait for one (their lease pinged), start when
a slot frees, and are given back at once when the worker stops; by default (``"auto"``) only
while runs are short, and a run that waited too long for its slot is given back."""

from __future__ import annotations

import poolhandlers
import pytest
import workerapp
from harness import running_worker, wait_for

from mtask import TaskClient
from mtask.errors import ConfigError
from mtask.worker import Worker
from mtask.worker.claiming.ahead import AdaptiveAhead


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


async def test_auto_claims_ahead_of_short_runs_and_gives_back_a_run_that_waited(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    async with running_worker(workerapp.registry, mongo_uri, db_name, concurrency=1) as (
        worker,
        events,
    ):
        ahead = worker.parts.claimer.ahead
        # nothing measured yet: runs are taken to be short
        assert isinstance(ahead, AdaptiveAhead) and ahead.allowed() == 1
        client.publish_many(
            [{"name": "add", "key": f"short{i}", "params": {"a": i, "b": 1}} for i in range(5)]
        )
        await events.wait("recorded", count=5)
        assert ahead.allowed() == 1 and ahead.run_s is not None  # shorter than a round trip
        client.publish("wait_cancel", "long")
        await events.wait("claimed", key="long")
        client.publish("add", "next", {"a": 1, "b": 1})
        claimed = await events.wait("claimed", key="next")  # ahead: its slot is taken
        assert worker.in_flight == 2
        # after GIVE_BACK_AFTER (1 s) it is given back, and no more runs are claimed ahead
        await events.wait("released", key="next", reason="slot_wait")
        await events.wait("recorded", key="next", state="RELEASED")
        assert ahead.allowed() == 0 and ahead.given_back == 1 and worker.in_flight == 1
        async with running_worker(workerapp.registry, mongo_uri, db_name, concurrency=1) as (
            other,
            other_events,
        ):
            await other_events.wait("recorded", key="next", state="SUCCESS")
        assert len(events.matching("claimed", key="next")) == 1  # it did not take it again
        client.cancel("long")
        await events.wait("recorded", key="long", state="CANCELLED")
    task = client.get("next")
    assert task is not None and task.status == "succeeded" and task.result == 2
    assert [r.state for r in task.runs] == ["RELEASED", "SUCCESS"]
    assert task.runs[0].run_id == claimed["run_id"] and task.runs[1].worker_id == other.worker_id
