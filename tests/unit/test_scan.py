"""The rescan's reads, call by call, without MongoDB: one find fills the queue, and a rescan
asked for by a queue that ran out searches for stranded documents once a sweep interval."""

from __future__ import annotations

import datetime as dt
from typing import Any

from finders import finder_for
from scripted import AsyncScriptedDriver, Step

from mtask.clock import FixedClock
from mtask.driver import Call
from mtask.worker.claim_queue import ClaimQueue
from mtask.worker.finding.scan import STRANDED_OPEN_EVERY

WHEN = dt.datetime(2026, 11, 25, 12, 0, tzinfo=dt.UTC)


def pending(i: int) -> dict[str, Any]:
    return {"_id": f"k{i:03}", "name": "n", "status": "pending", "next_claim_at": WHEN}


def scan(limit: int, after: object = None, reply: list[dict[str, Any]] | None = None) -> Step:
    def check(call: Call) -> None:
        assert call.kwargs["limit"] == limit
        filt = call.args[0]
        assert ("$and" in filt) == (after is not None)  # no page after another: no `after`

    return Step("find", reply or [], check=check)


def stranded(open_too: bool) -> list[Step]:
    def check(call: Call) -> None:
        branches = call.args[0]["$or"]
        # the open documents' search (stranded_open) is the branch with a status and an $or
        assert any("$or" in b for b in branches) == open_too

    return [Step("distinct", ["n"]), Step("find", [], check=check)]


async def test_one_find_fills_the_queue_and_sees_the_first_task_left_out() -> None:
    queue = ClaimQueue(100)
    driver = AsyncScriptedDriver(
        scan(101, reply=[pending(i) for i in range(101)]), *stranded(open_too=True)
    )
    finder = finder_for(driver, FixedClock(WHEN), ["n"], queue=queue)
    assert await finder.scanner.rescan() == 101
    assert driver.done and len(queue) == 100
    assert queue.overflowed and queue.overflow_at == WHEN


async def test_pages_follow_on_from_the_last_when_a_page_size_caps_them() -> None:
    queue = ClaimQueue(100)
    driver = AsyncScriptedDriver(
        scan(60, reply=[pending(i) for i in range(60)]),
        scan(41, after=True, reply=[pending(i) for i in range(60, 101)]),
        *stranded(open_too=True),
    )
    finder = finder_for(driver, FixedClock(WHEN), ["n"], queue=queue)
    finder.scanner.page_size = 60
    await finder.scanner.rescan()
    assert driver.done and len(queue) == 100 and "k100" not in queue and queue.overflowed


async def test_a_requested_rescan_searches_for_stranded_documents_once_an_interval() -> None:
    clock = FixedClock(WHEN)
    driver = AsyncScriptedDriver(scan(101), *stranded(open_too=True))
    finder = finder_for(driver, clock, ["n"], queue=ClaimQueue(100))
    scanner = finder.scanner
    await scanner.rescan()  # the first: the whole search
    for _ in range(3):  # a backlog's refills, within the interval: the scan alone
        clock.advance(seconds=scanner.sweep_interval / 4)
        driver.expect(scan(101))
        await scanner.rescan(requested=True)
    clock.advance(seconds=scanner.sweep_interval / 4)  # an interval since the last search
    driver.expect(scan(101), *stranded(open_too=False))
    await scanner.rescan(requested=True)
    driver.expect(scan(101), *stranded(open_too=False))
    await scanner.rescan()  # the periodic sweep's: always
    assert driver.done and scanner.rescans == 6 and scanner.stranded_searches == 3
    for _ in range(STRANDED_OPEN_EVERY - 3):  # every tenth search reads the open documents
        driver.expect(scan(101), *stranded(open_too=False))
        await scanner.rescan()
    driver.expect(scan(101), *stranded(open_too=True))
    await scanner.rescan()
    assert driver.done
