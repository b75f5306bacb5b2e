"""The side services' shared skeleton, and the rounds (``run_once``) of the two loops that had
none: the flow sweep and the scheduler, against a scripted driver."""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from typing import ClassVar, cast

import pytest
from pymongo.errors import AutoReconnect
from pymongo.results import UpdateResult
from scripted import AsyncScriptedDriver, Step

from mtask.clock import FixedClock
from mtask.driver import AsyncDriver
from mtask.errors import StorageError
from mtask.worker.maintenance.flow_sweep import FlowSweep
from mtask.worker.maintenance.scheduler import POLL_SECONDS, Scheduler
from mtask.worker.service import PeriodicService

NOW = dt.datetime(2026, 3, 1, 12, 0, tzinfo=dt.UTC)


class Flaky(PeriodicService):
    name: ClassVar[str] = "flaky"
    failure: ClassVar[str] = "flaky failed, will retry"
    run_first: ClassVar[bool] = True
    interval = 0.0

    def __init__(self, errors: list[BaseException]) -> None:
        self.to_raise = errors
        self.rounds = 0

    async def run_once(self) -> None:
        self.rounds += 1
        if self.to_raise:
            raise self.to_raise.pop(0)


async def test_a_storage_error_is_logged_and_the_next_round_comes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    service = Flaky([StorageError("no primary", transient=True), RuntimeError("a bug")])
    with pytest.raises(RuntimeError, match="a bug"):  # anything else ends the service loudly
        await asyncio.wait_for(service.run(), 5)
    assert service.rounds == 2
    [record] = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert record.getMessage() == "flaky failed, will retry: no primary"
    assert record.name == __name__ and record.service == "flaky"  # type: ignore[attr-defined]


async def test_a_flow_sweep_round_publishes_stale_outboxes_and_resolves_dependencies() -> None:
    driver = AsyncScriptedDriver(
        Step("find", reply=[]),  # outboxes older than one interval: none
        Step("find", reply=[{"waiting_on": ["a"]}]),  # the awaited dependencies
        Step("find", reply=[{"_id": "a", "status": "succeeded"}]),  # resolve: "a" succeeded
        Step("update_many", reply=UpdateResult({"n": 1, "nModified": 1}, acknowledged=True)),
        Step("find", reply=[]),  # flow parents held for their steps: none
        Step("find", reply=[]),  # parents waiting for their children: none
        Step("find", reply=[]),  # parents cancelled while their run spawned: none
    )
    sweep = FlowSweep(cast(AsyncDriver, driver), FixedClock(NOW), interval=5.0)
    await sweep.run_once()
    assert driver.done
    assert driver.calls[0].args[0]["updated_at"] == {"$lt": NOW - dt.timedelta(seconds=5)}


async def test_a_scheduler_round_writes_the_declared_schedules_once_then_fires_due_ones() -> None:
    upcoming = NOW + dt.timedelta(milliseconds=300)
    driver = AsyncScriptedDriver(
        Step("create_index", collection="schedules"),
        Step("find", reply=[], collection="schedules"),  # nothing due
        Step("find_one", reply={"next_tick_at": upcoming}, collection="schedules"),
    )
    clock = FixedClock(NOW)
    scheduler = Scheduler(cast(AsyncDriver, driver), clock, [])
    await scheduler.run_once()
    assert driver.done and scheduler.upcoming == upcoming
    driver.expect(
        Step("find", reply=[], collection="schedules"),  # indexes and schedules not again
        Step("find_one", reply=None, collection="schedules"),
    )
    await scheduler.run_once()
    assert driver.done and scheduler.upcoming is None
    # a failed round forgets the next tick: the scheduler then polls every POLL_SECONDS
    driver.expect(Step("find", raises=AutoReconnect("gone"), collection="schedules"))
    with pytest.raises(StorageError):
        await scheduler.run_once()
    assert scheduler.upcoming is None and POLL_SECONDS == 10.0
