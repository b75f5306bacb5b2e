"""A trigger exactly once under faults (docs/triggers.md): 10,000 business writes to
``orders`` on a three-member replica set, about half of them changes to paid orders, while real
worker processes follow the trigger and the one that holds it is killed with ``kill -9`` twice,
and the primary once. Every change to a paid order that MongoDB kept gets exactly one task, and
no other change gets any: counted per document against the writes the collection holds."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from harness import replica_set_with_workers
from pymongo import MongoClient
from pymongo.errors import DuplicateKeyError, PyMongoError

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(1800)]

WRITES = 10_000
APP = "triggerapp:registry"
FOLLOWER = "tasks/trigger/ship"


class Writer:
    """The application: inserts orders (every other one paid) and updates random ones, each
    update setting a field of its own (``u<n>``), so the collection says which writes landed.
    A write that fails in a failover is sent again until it lands (an insert that finds its
    ``_id`` there, or an update setting a field already set, changes nothing)."""

    def __init__(self, uri: str, database: str) -> None:
        self.client: MongoClient[dict[str, Any]] = MongoClient(
            uri, w="majority", retryWrites=True, serverSelectionTimeoutMS=60_000
        )
        self.orders = self.client[database]["orders"]
        self.done = 0
        self.error: BaseException | None = None
        self.rng = random.Random(63)

    def _again(self, write: Any) -> None:
        deadline = time.monotonic() + 120
        while True:
            try:
                write()
                return
            except DuplicateKeyError:
                return  # an insert sent again: the first landed
            except PyMongoError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def run(self) -> None:
        inserted = 0
        try:
            for n in range(WRITES):
                if n % 2 == 0 or inserted == 0:
                    doc = {"_id": inserted, "kind": "paid" if inserted % 2 == 0 else "new"}
                    self._again(lambda doc=doc: self.orders.insert_one(doc))
                    inserted += 1
                else:
                    where = {"_id": self.rng.randrange(inserted)}
                    change = {"$set": {f"u{n}": 1}}
                    self._again(lambda w=where, c=change: self.orders.update_one(w, c))
                self.done += 1
        except BaseException as exc:  # noqa: BLE001 - the test says it
            self.error = exc


def _holder(mongo: MongoClient[dict[str, Any]], database: str) -> str | None:
    with contextlib.suppress(PyMongoError):
        doc = mongo[database]["triggers"].find_one({"_id": FOLLOWER}, {"holder": 1})
        return None if doc is None else doc.get("holder")
    return None


async def _until(check: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(PyMongoError):
            value = check()
            if value:
                return value
        await asyncio.sleep(0.2)
    raise AssertionError(f"not reached in {timeout:g} s: {what}")


def _expected(mongo: MongoClient[dict[str, Any]], database: str) -> Counter[Any]:
    """The changes that publish, per order: its insert and each update it holds, if paid."""
    expected: Counter[Any] = Counter()
    for doc in mongo[database]["orders"].find({"kind": "paid"}):
        expected[doc["_id"]] = 1 + sum(1 for k in doc if k.startswith("u"))
    return expected


def _published(mongo: MongoClient[dict[str, Any]], database: str) -> Counter[Any]:
    found: Counter[Any] = Counter()
    for task in mongo[database]["tasks"].find({"name": "ship"}, {"params._id": 1}):
        found[task["params"]["_id"]] += 1
    return found


def _diagnosis(mongo: MongoClient[dict[str, Any]], database: str, cluster: Any, total: int) -> str:
    """What a stalled trigger looks like: its document, the count, each worker's complaints."""
    follower = mongo[database]["triggers"].find_one({"_id": FOLLOWER})
    lines = [f"published {sum(_published(mongo, database).values())} of {total}", f"{follower}"]
    for worker in sorted(cluster.procs):
        said = [
            line[:300]
            for line in cluster.log_of(worker).splitlines()
            if " WARNING " in line or " ERROR " in line or "follow" in line or "Traceback" in line
        ]
        alive = cluster.procs[worker].poll() is None
        lines.append(f"--- {worker} (alive: {alive}): " + "\n".join(said[-25:]))
    return "\n".join(lines)


async def test_a_trigger_publishes_exactly_one_task_per_matching_change_under_kills(
    tmp_path: Path, db_name: str
) -> None:
    replica_set, cluster = await replica_set_with_workers(tmp_path, db_name)
    uri = cluster.uri
    mongo: MongoClient[dict[str, Any]] = MongoClient(uri, tz_aware=True)
    writer = Writer(uri, db_name)
    thread = threading.Thread(target=writer.run, name="orders-writer", daemon=True)
    spawned = 0

    def spawn() -> None:
        nonlocal spawned
        spawned += 1
        cluster.spawn(f"w{spawned}", "--names", "idle", "--concurrency", "2", app=APP)

    try:
        for _ in range(3):
            spawn()
        first = await _until(lambda: _holder(mongo, db_name), 60, "a worker follows the trigger")
        thread.start()
        kills: list[str] = []
        for at in (WRITES // 5, WRITES // 2):  # kill -9 the follower twice, mid-stream
            await _until(lambda at=at: writer.done >= at or writer.error, 600, f"{at} writes")
            holder = await _until(lambda: _holder(mongo, db_name), 60, "a holder")
            cluster.signal(holder, signal.SIGKILL)
            kills.append(holder)
            spawn()
            await _until(
                lambda holder=holder: _holder(mongo, db_name) not in (None, holder),
                60,
                "a standby takes the trigger over",
            )
        await _until(lambda: writer.done >= WRITES * 7 // 10 or writer.error, 600, "70 %")
        old = await asyncio.to_thread(replica_set.wait_primary)
        os.kill(replica_set.pids.pop(old), signal.SIGKILL)  # the primary, killed
        await asyncio.to_thread(replica_set.wait_primary, 60, old)
        await asyncio.to_thread(replica_set._launch, old)  # back as a secondary
        await asyncio.to_thread(thread.join, 900)
        assert writer.error is None, writer.error
        assert writer.done == WRITES
        expected = _expected(mongo, db_name)
        total = sum(expected.values())
        try:
            await _until(
                lambda: sum(_published(mongo, db_name).values()) >= total,
                300,
                f"{total} tasks published",
            )
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{_diagnosis(mongo, db_name, cluster, total)}") from None
        # the follower's position is past the last write: nothing more will come
        last = mongo[db_name]["orders"].insert_one({"_id": "last", "kind": "paid"})
        await _until(
            lambda: mongo[db_name]["tasks"].find_one({"params._id": last.inserted_id}),
            120,
            "the last write's task",
        )
        published = _published(mongo, db_name)
        published.pop("last")
        assert kills == [first, kills[1]] and len(set(kills)) == 2
        assert published == expected, {
            "missing": dict((expected - published).most_common(5)),
            "extra": dict((published - expected).most_common(5)),
        }
        unpaid = {d["_id"] for d in mongo[db_name]["orders"].find({"kind": "new"}, {"_id": 1})}
        assert not unpaid & set(published)
        print(
            f"{WRITES} writes, {total} matching changes, {len(expected)} paid orders: "
            f"{sum(published.values())} tasks; follower killed {len(kills)} times, primary once"
        )
    finally:
        cluster.close()
        mongo.close()
        writer.client.close()
        replica_set.stop()
