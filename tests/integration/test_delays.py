"""Delayed tasks wake the worker's heap on time; priorities jump the queue."""

from __future__ import annotations

import asyncio
import datetime as dt
from typing import Any

from harness import running_worker

from mtask import TaskClient
from mtask.registry import Registry

registry = Registry()


@registry.task("quick")
async def quick(params: dict[str, Any]) -> None:
    return None


@registry.task("slow")
async def slow(params: dict[str, Any]) -> None:
    await asyncio.sleep(params.get("s", 0.05))


async def test_a_delayed_task_is_claimed_on_time_by_the_heap(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    # no sweep during the test: only the heap's timer can start the delayed tasks
    async with running_worker(registry, mongo_uri, db_name, sweep_interval=3600) as (w, events):
        rescans = w.parts.finding.finder.scanner.rescans
        client.publish("quick", "by-delay", delay=dt.timedelta(milliseconds=400))
        run_at = client.now() + dt.timedelta(milliseconds=300)
        client.publish("quick", "by-run-at", options={"run_at": run_at})
        await events.wait("recorded", key="by-delay")
        await events.wait("recorded", key="by-run-at")
        assert w.parts.finding.finder.scanner.rescans == rescans  # no scan found them
    for key in ("by-delay", "by-run-at"):
        task = client.get(key)
        assert task is not None and task.options.run_at is not None
        # never before run_at by the server's clock (claimed_at is the worker's server time)
        assert task.runs[0].claimed_at >= task.options.run_at
        assert task.attempts == 1


async def test_a_high_priority_task_waits_at_most_one_claim_round(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    concurrency = 4
    async with running_worker(registry, mongo_uri, db_name, concurrency=concurrency) as (
        _,
        events,
    ):
        # runs of 0.3 s: a slot frees rarely, so the urgent task's change event reaches the
        # worker before the next round of claims even on a loaded machine (with 50 ms runs a
        # slow event let a second round of low claims go first: 5 > 4 in one CI run)
        client.publish_many(
            {"name": "slow", "key": f"low{i}", "params": {"s": 0.3}, "options": {"priority": -5}}
            for i in range(1000)
        )
        await events.wait("claimed", count=2 * concurrency)  # the queue is busy
        mark = len(events.items)
        client.publish("slow", "urgent", {"s": 0}, options={"priority": 10})
        await events.wait("claimed", key="urgent")
        after = events.items[mark:]
        urgent_at = next(i for i, (e, d) in enumerate(after) if d.get("key") == "urgent")
        low_claims = [d for e, d in after[:urgent_at] if e == "claimed"]
        # only claims already on their way (at most one round of free slots) go first
        assert len(low_claims) <= concurrency, len(low_claims)
        pending = client.stats()["slow"].get("pending", 0)
        assert pending > 900  # the low-priority backlog was there all along
