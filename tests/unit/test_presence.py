"""The heartbeat's reads, without MongoDB: the exact calls of a beat (``scripted``)."""

from __future__ import annotations

import asyncio
import datetime as dt

from bson import ObjectId
from scripted import AsyncScriptedDriver, Step

from mtask.clock import FixedClock
from mtask.driver import MODIFY_ONCE
from mtask.worker.inflight import InFlight
from mtask.worker.presence import Assignment, Presence, WorkerState
from mtask.worker.worker_events import Emitter

NOW = dt.datetime(2026, 11, 27, 9, 0, tzinfo=dt.UTC)


class Running:
    state: WorkerState = "running"

    def stop(self, immediate: bool = False) -> None:
        raise AssertionError("not asked to stop")


class NoRescan:
    def request_rescan(self) -> None:
        raise AssertionError("nothing was resumed")


def presence(driver: AsyncScriptedDriver, ranks: list[bool]) -> Presence:
    return Presence(
        driver,  # type: ignore[arg-type]
        FixedClock(NOW),
        worker_id="w1",
        concurrency=4,
        interval=2.0,
        inflight=InFlight(),
        lifecycle=Running(),
        emit=Emitter(),
        assignment=Assignment(("a",)),
        rescanner=NoRescan(),
        controls_changed=asyncio.Event(),
        ranks=lambda: ranks[0],
    )


def beat() -> Step:
    return Step(MODIFY_ONCE, {"_id": "w1", "stop_requested": False}, collection="workers")


async def test_a_beat_reads_the_peers_only_while_the_worker_ranks_by_them() -> None:
    ranks = [True]
    driver = AsyncScriptedDriver(
        beat(),
        Step("find", [], collection="controls"),
        Step(
            "find",
            [{"_id": "w1", "names": ["a"]}, {"_id": "w2", "names": ["a"]}],
            collection="workers",
        ),
    )
    heart = presence(driver, ranks)
    await heart.run_once()  # the first beat reads
    assert driver.done
    assert heart.assignment.peers == {"a": ["w1", "w2"]}

    ranks[0] = False  # the relay hands this worker its tasks: nothing to rank
    heart.beats = 0
    driver.expect(beat(), Step("find", [], collection="controls"))
    await heart.run_once()
    assert driver.done  # the paused names, and no read of the peers
    assert heart.assignment.peers == {"a": ["w1", "w2"]}  # kept for when it ranks again


async def test_peers_of_any_shape_stop_nothing() -> None:
    """A heartbeat document edited by hand (names not a list, a name not a string, a key not a
    string) is left out of the ranking; it raised TypeError out of the heartbeat, which stopped
    the worker."""
    driver = AsyncScriptedDriver(
        beat(),
        Step("find", [], collection="controls"),
        Step(
            "find",
            [
                {"_id": "w1", "names": ["a"]},
                {"_id": "w2", "names": 5},
                {"_id": "w3", "names": [{"x": 1}, ["a"], "a"]},
                {"_id": ObjectId(), "names": ["a"]},
                {"_id": "w4"},
            ],
            collection="workers",
        ),
    )
    heart = presence(driver, [True])
    await heart.run_once()
    assert driver.done
    assert heart.assignment.peers == {"a": ["w1", "w3"]}
