"""Documents whose dates sit at the edges of what Python can hold, found by a worker's scan and
its change stream: no worker stops, and the other tasks run."""

from __future__ import annotations

import asyncio
import datetime as dt
from typing import Any

import pytest
from bson import DatetimeMS
from harness import hand_written, running_worker, wait_for
from workerapp import registry

from mtask import TaskClient

LAST = dt.datetime(9999, 12, 31, 23, 59, 59, 999000, tzinfo=dt.UTC)


def _doc(client: TaskClient, key: Any, **fields: Any) -> dict[str, Any]:
    return hand_written(client.now(), _id=key, **fields)


async def test_a_claim_time_at_the_last_date_stops_no_staggered_worker(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    """A worker that ranks second for a task placed it one stagger after its claim time: past
    the last date Python holds, an OverflowError that stopped the worker at its next scan."""
    client.collection.insert_many([_doc(client, f"last{i}", next_claim_at=LAST) for i in range(8)])
    async with (
        running_worker(registry, mongo_uri, db_name, stream="own", sweep_interval=0.2) as (a, _),
        running_worker(registry, mongo_uri, db_name, stream="own", sweep_interval=0.2) as (b, _),
    ):
        peers = {a.worker_id, b.worker_id}
        await wait_for(
            lambda: all(set(w.parts.assignment.peers.get("add", ())) == peers for w in (a, b))
        )
        scanners = [w.parts.finding.finder.scanner for w in (a, b)]
        scans = [s.rescans for s in scanners]
        await wait_for(lambda: all(s.rescans > n + 1 for s, n in zip(scanners, scans, strict=True)))
        client.publish("add", "after", {"a": 1, "b": 2})
        await wait_for(lambda: (t := client.get("after")) is not None and t.status == "succeeded")
        assert a.state == b.state == "running"


@pytest.mark.parametrize("stream", ["own", "shared"])
async def test_a_date_no_python_date_can_hold_stops_no_worker(
    mongo_uri: str, db_name: str, client: TaskClient, stream: str
) -> None:
    """A date past year 9999 (or before year 1) is valid BSON that PyMongo cannot decode:
    read by the scan, carried by a change event or by a claim's reply, it raised InvalidBSON
    out of the worker. It reads as the first or last date: a claim time long past is due."""
    far, early = DatetimeMS(2**60), DatetimeMS(-(2**60))
    options = _doc(client, "x")["options"]
    client.collection.insert_many(
        [
            _doc(client, "far-claim", next_claim_at=far),
            _doc(client, "early-claim", next_claim_at=early),
            _doc(client, "early-place", available_at=early),
        ]
    )
    async with running_worker(registry, mongo_uri, db_name, stream=stream, sweep_interval=0.2) as (
        w,
        events,
    ):
        client.collection.insert_many(
            [
                _doc(client, far),
                _doc(client, "late-early", next_claim_at=early),
                _doc(client, "late-opt", options={**options, "priority": far}),
                *(_doc(client, f"p{i}", params={"a": i, "b": 1}) for i in range(5)),
                _doc(client, "late-params", params={"a": 1, "b": 1, "at": far}),
            ]
        )
        done = ["early-claim", "early-place", "late-early", "late-params"]
        for key in [*done, *(f"p{i}" for i in range(5))]:
            await events.wait("recorded", key=key)
        marked = {"_id": far, "status": "invalid"}
        await wait_for(lambda: client.collection.find_one(marked, {"_id": 0}))
        scans = w.parts.finding.finder.scanner.rescans
        await wait_for(lambda: w.parts.finding.finder.scanner.rescans > scans + 1)
        assert w.state == "running"
    for key in done:
        assert client.collection.find_one({"_id": key}, {"status": 1})["status"] == "succeeded"
    assert client.collection.find_one({"_id": "far-claim"}, {"status": 1})["status"] == "pending"


async def test_a_rescan_ends_over_pages_of_dates_past_the_last(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    """A page of claim times past year 9999 ends at the last date, as the worker reads them; the
    next page, read from there, found the same tasks again (their stored dates are later), and
    a rescan over a page's worth of them read that page for ever."""
    far = DatetimeMS(2**60)
    client.collection.insert_many([_doc(client, f"far{i}", next_claim_at=far) for i in range(5)])
    async with running_worker(registry, mongo_uri, db_name, sweep_interval=3600) as (worker, _):
        scanner = worker.parts.finding.finder.scanner
        scanner.page_size = 2
        found = await asyncio.wait_for(scanner.rescan(), timeout=30)
        assert found >= 2 and worker.state == "running"
        client.publish("add", "after", {"a": 1, "b": 2})
        await wait_for(lambda: (t := client.get("after")) is not None and t.status == "succeeded")
    for i in range(5):
        assert client.collection.find_one({"_id": f"far{i}"}, {"status": 1})["status"] == "pending"
