"""Cost units on the real replica set: a run of a name declared ``units=…`` takes
that many of a limit's runs at once and tokens, in the server's take, mixed with runs of one
unit in a shared resource; held by in-process workers."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import time
from typing import Any

import pytest
from harness import running_worker, wait_for
from pymongo import MongoClient
from workerapp import timed_sleep

from mtask import TaskClient
from mtask.driver import SyncDriver
from mtask.errors import InvalidTask
from mtask.limits import rules as limits
from mtask.limits import slots
from mtask.registry import Registry
from mtask.store import slots as store_slots

T0 = dt.datetime(2099, 1, 1, 9, tzinfo=dt.UTC)
registry = Registry()


class Gate:
    """Open once the runs in flight hold ``ENOUGH`` units: until then each run waits at it (at
    most ``HOLD`` seconds), so that as many units as the limit lets run do run at once. (Runs of
    0.1 s alone need not overlap on a starved machine: each may end before the next starts.)"""

    ENOUGH = 4
    HOLD = 20.0

    def __init__(self) -> None:
        self.units = 0
        self.opened = asyncio.Event()

    async def run(self, units: int, seconds: float) -> list[float]:
        """A run of ``units``: when it started and ended on this process's monotonic clock
        (one clock for every run: the workers run in the test's process)."""
        start = time.monotonic()
        self.units += units
        try:
            if self.units >= self.ENOUGH:
                self.opened.set()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.opened.wait(), self.HOLD)
            await asyncio.sleep(seconds)
        finally:
            self.units -= units
        return [start, time.monotonic()]


GATE = Gate()


async def big(params: dict[str, float]) -> list[float]:
    return await GATE.run(3, params["seconds"])


async def small(params: dict[str, float]) -> list[float]:
    return await GATE.run(1, params["seconds"])


registry.task("big", uses=["gpu"], units=3)(big)
registry.task("small", uses=["gpu"])(small)


def test_the_servers_take_counts_units_of_runs_at_once_and_tokens(
    client: TaskClient, mongo: MongoClient[Any], db_name: str
) -> None:
    client.set_limit(resource="gpu", concurrency=4)
    client.set_limit("n", rate=2.0, burst=5)
    driver = SyncDriver(mongo[db_name])
    gpu = limits.resource_slot("gpu")

    def take(slot: str, run: str, units: int, at: dt.datetime = T0) -> bool:
        request = slots.Request(slot, run, f"k-{run}", 60_000, units=units)
        (taken,) = driver.run(store_slots.take([request], "w", at))
        return taken.taken

    assert take(gpu, "r1", 3)
    assert not take(gpu, "r2", 2)  # 3 + 2 > 4
    assert take(gpu, "r3", 1)  # 3 + 1 = 4
    driver.run(store_slots.release({gpu: ["r1"]}))
    assert take(gpu, "r4", 3)
    holders = mongo[db_name].limits.find_one({"_id": gpu})["holders"]
    assert sorted(h.get("units", 1) for h in holders) == [1, 3]
    assert take("n", "t1", 4)  # a rate: 5 tokens, 4 taken
    assert not take("n", "t2", 2)  # 1 left
    assert take("n", "t3", 2, T0 + dt.timedelta(seconds=1))  # 1 + 2 refilled
    for bad in (0, 1001, True, 2.5):
        with pytest.raises(InvalidTask):
            Registry().task("x", units=bad)(timed_sleep)  # type: ignore[arg-type]
    assert registry.units == {"big": 3}


def load(db: Any) -> int:
    """The most units at once, from the handlers' own times (one process, one clock)."""
    points = []
    for doc in db.tasks.find({"status": "succeeded"}):
        units = 3 if doc["name"] == "big" else 1
        start, end = doc["result"]
        points += [(start, units), (end, -units)]
    running = most = 0
    for _, step in sorted(points):
        running += step
        most = max(most, running)
    return most


async def test_workers_hold_a_resource_to_its_units(
    mongo_uri: str, mongo: MongoClient[Any], db_name: str, client: TaskClient
) -> None:
    global GATE
    GATE = Gate()  # this test's loop's
    client.set_limit(resource="gpu", concurrency=5)
    client.publish_many(
        [
            {"name": name, "key": f"{name}/{i}", "params": {"seconds": 0.1}}
            for i in range(8)
            for name in ("big", "small")
        ]
    )
    async with contextlib.AsyncExitStack() as stack:
        for _ in range(2):
            await stack.enter_async_context(
                running_worker(registry, mongo_uri, db_name, concurrency=8)
            )
        db = mongo[db_name]
        await wait_for(lambda: db.tasks.count_documents({"status": "succeeded"}) == 16, 60)
    # 4 units or more at once (the gate held the first runs until they were), and never more
    # than the limit: a big run (3) and two small ones at most, never two big
    assert 3 < load(db) <= 5
