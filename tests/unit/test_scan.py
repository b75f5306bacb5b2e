"""The rescan's reads, call by call, without MongoDB: one find fills the queue, and a rescan
asked for by a queue that ran out searches for stranded documents once a sweep interval."""

from __future__ import annotations

import asyncio
import datetime as dt
from types import SimpleNamespace
from typing import Any

import pytest
from finders import finder_for
from pymongo.errors import NotPrimaryError, WriteError
from scripted import AsyncScriptedDriver, Step

from mtask.clock import FixedClock
from mtask.driver import Call
from mtask.errors import StorageError
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


# -- the top-up: reading on from the first task a full queue left out ----------------------------


def top_up(start: tuple[dt.datetime, str], limit: int, reply: list[dict[str, Any]]) -> Step:
    def check(call: Call) -> None:
        assert call.kwargs["limit"] == limit and call.kwargs["batch_size"] == 1000
        [_, bound] = call.args[0]["$and"]
        at, key = start
        assert bound["$or"] == [
            {"name": "n", "next_claim_at": {"$gt": at}},
            {"name": "n", "next_claim_at": at, "_id": {"$gte": key}},
        ]

    return Step("find", reply, check=check)


async def full_queue() -> tuple[Any, ClaimQueue, AsyncScriptedDriver]:
    """A queue of 100 filled by a rescan of 101 tasks (k000…k100): k100 left out."""
    queue = ClaimQueue(100)
    driver = AsyncScriptedDriver(
        scan(101, reply=[pending(i) for i in range(101)]), *stranded(open_too=True)
    )
    finder = finder_for(driver, FixedClock(WHEN), ["n"], queue=queue)
    await finder.scanner.rescan()
    assert queue.resume == (WHEN, "k100") and not queue.wants_top_up()
    return finder, queue, driver


async def test_a_top_up_reads_on_from_the_first_task_left_out_without_clearing() -> None:
    finder, queue, driver = await full_queue()
    assert len(queue.pop_due(WHEN, 49)) == 49 and not queue.wants_top_up()
    assert await finder.scanner.top_up() == 0  # more than half is left: nothing read
    assert len(queue.pop_due(WHEN, 1)) == 1 and queue.wants_top_up()  # half is gone
    # room for 50 and the first left out again: k150 does not fit
    driver.expect(top_up((WHEN, "k100"), 51, [pending(i) for i in range(100, 151)]))
    assert await finder.scanner.top_up() == 51
    assert driver.done and len(queue) == 100
    assert {f"k{i:03}" for i in range(50, 150)} == set(queue.entries)  # the rest kept
    assert queue.resume == (WHEN, "k150")


async def test_a_top_up_that_reads_the_last_tasks_leaves_nothing_out() -> None:
    finder, queue, driver = await full_queue()
    queue.pop_due(WHEN, 60)
    driver.expect(top_up((WHEN, "k100"), 61, [pending(i) for i in range(100, 120)]))
    assert await finder.scanner.top_up() == 20
    assert len(queue) == 60 and queue.resume is None and not queue.overflowed


async def test_a_top_up_that_fills_its_page_notes_the_last_task_read() -> None:
    """A page as long as its limit may have more behind it, though some of it was not queued
    (here: two tasks in flight), so the queue is not full: the next top-up starts there."""
    queue = ClaimQueue(100)
    driver = AsyncScriptedDriver(
        scan(101, reply=[pending(i) for i in range(101)]), *stranded(open_too=True)
    )
    finder = finder_for(
        driver, FixedClock(WHEN), ["n"], queue=queue, in_flight=lambda key: key in ("k120", "k121")
    )
    await finder.scanner.rescan()
    queue.pop_due(WHEN, 60)
    driver.expect(top_up((WHEN, "k100"), 61, [pending(i) for i in range(100, 161)]))
    await finder.scanner.top_up()
    assert len(queue) == 99 and queue.resume == (WHEN, "k160")


async def test_a_failed_top_up_keeps_where_to_read_on_from() -> None:
    finder, queue, driver = await full_queue()
    queue.pop_due(WHEN, 60)
    driver.expect(Step("find", raises=NotPrimaryError("stepped down")))
    with pytest.raises(StorageError):
        await finder.scanner.top_up()
    assert queue.resume == (WHEN, "k100") and queue.wants_top_up()


async def test_a_rescan_after_a_top_up_was_asked_for_makes_it_read_nothing() -> None:
    finder, queue, driver = await full_queue()
    queue.pop_due(WHEN, 60)
    driver.expect(scan(101, reply=[pending(i) for i in range(60, 100)]))
    await finder.scanner.rescan(requested=True)  # within the interval: no stranded search
    assert queue.resume is None
    assert await finder.scanner.top_up() == 0 and driver.done


class GatedDriver(AsyncScriptedDriver):
    """A scripted driver whose calls take a turn of the loop each, and whose first write of
    ``held``'s key waits for ``gate``: two operations at once interleave as on a server."""

    def __init__(self, held: str, *steps: Step) -> None:
        super().__init__(*steps)
        self.held = held
        self.gate = asyncio.Event()
        self.holding = asyncio.Event()

    async def run(self, op: Any) -> Any:
        try:
            call = next(op)
            while True:
                if call.method == "update_many" and self.held in call.args[0]["_id"]["$in"]:
                    self.holding.set()
                    await self.gate.wait()
                await asyncio.sleep(0)
                call = op.send(self._answer(call))
        except StopIteration as stop:
            return stop.value


def writes_of(key: str) -> list[Step]:
    def check(call: Call) -> None:
        assert call.args[0]["_id"]["$in"] == [key], "another key's write came first"

    return [Step("update_many", SimpleNamespace(modified_count=0), check=check)] * 3


async def test_the_stranded_search_completes_after_a_quarantine_on_its_way() -> None:
    # Completing a document sets its publish_seq from the server's time: the stream's
    # quarantine of an earlier-published key, on its way, must land before the stranded
    # search's of a later one, or a sequence could run the later task first.
    driver = GatedDriver(
        "seq/0",
        Step("distinct", ["n"]),
        Step("find", [{"_id": "seq/1"}]),
        *writes_of("seq/0"),
        *writes_of("seq/1"),
    )
    scanner = finder_for(driver, FixedClock(WHEN), ["n"]).scanner
    scanner.malformed.add("seq/0")  # a status-less document the stream saw
    first = asyncio.create_task(scanner.quarantine())
    await driver.holding.wait()
    later = asyncio.create_task(scanner._stranded())
    for _ in range(20):  # the stranded search's find, and its write if nothing holds it
        await asyncio.sleep(0)
    driver.gate.set()
    await asyncio.gather(first, later)
    assert driver.done


def refused(*keys: str) -> Step:
    """The first write of a quarantine of ``keys``, refused by the server for a document."""

    def check(call: Call) -> None:
        assert call.args[0]["_id"]["$in"] == list(keys)

    error = WriteError("Document failed validation", 121, {})
    return Step("update_many", raises=error, check=check)


async def test_a_stranded_document_the_server_refuses_stops_nothing_else() -> None:
    # the stranded search settles through the same path as the stream's quarantine: a batch
    # the server refuses is settled key by key, and the refused key is let go
    driver = AsyncScriptedDriver(
        Step("distinct", ["n"]),
        Step("find", [{"_id": "good"}, {"_id": "bad"}]),
        refused("good", "bad"),
        *writes_of("good")[:2],
        Step("update_many", SimpleNamespace(modified_count=1)),
        refused("bad"),
    )
    scanner = finder_for(driver, FixedClock(WHEN), ["n"]).scanner
    await scanner._stranded()
    assert driver.done
    assert scanner.placement.ignored == {"bad"}
