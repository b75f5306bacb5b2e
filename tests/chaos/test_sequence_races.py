"""A sequence never overlaps when late publishes, retries, a reopened task and a resumed zombie
race a running task (promises with teeth). Two worker processes run one group in
sequence (``group_concurrency=1``); while it runs, tasks are published late, two fail once and
are retried, a task that failed for good is reopened (its place is earlier than the running
one's), and a worker is frozen past its lease mid-run and thawed after another took its task
over. Every run's own start and end (``execlog``, the server's clock) are compared across the
whole group: no two overlap. A run whose lease ran out while its worker was frozen counts until
its lease's end, when the server let another take its task (its later writes are fenced:
``test_zombie_writes``), as the chaos invariants read it."""

from __future__ import annotations

import asyncio
import datetime as dt
import itertools
import signal
from typing import Any

import pytest
from bson import ObjectId
from harness import Cluster, wait_for
from invariants import check
from pymongo import MongoClient

from mtask import TaskClient, store
from mtask.driver import SyncDriver, collections
from mtask.store import Outcome, RunState

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(600)]

LEASE = {"worker_timeout_ms": 1500, "ping_interval_ms": 300, "retry_delay_ms": 50}


def intervals(db: Any, keys: set[str]) -> list[tuple[dt.datetime, dt.datetime, str]]:
    """Each run of ``keys``: its start, its end (a run taken over after its lease ran out
    ends at that lease's end, by the server's clock), and its run id."""
    runs = {
        r["run_id"]: r
        for d in db.tasks.find({"_id": {"$in": sorted(keys)}}, {"runs": 1})
        for r in d.get("runs", [])
    }
    logged: dict[str, dict[str, dt.datetime]] = {}
    for e in db.execlog.find({"key": {"$in": sorted(keys)}}):
        logged.setdefault(e["run_id"], {})[e["event"]] = e["at"]
    out = []
    for run_id, events in logged.items():
        start = events["start"]
        end = next((events[k] for k in ("finish", "fail", "cancelled") if k in events), None)
        run = runs.get(run_id, {})
        if run.get("state") == "TIMEOUT":  # taken over once its lease ran out
            end = min(end, run["lease_expires_at"]) if end else run["lease_expires_at"]
        assert end is not None, f"run {run_id} never ended: {events} {run.get('state')}"
        out.append((start, end, run_id))
    return sorted(out)


class Believer:
    """A worker that believes any pending task of the group is its to run (a stale view, a
    version with another planner): it claims one with the group's lock whenever it can
    (``store.claim_locked``, the claim every worker makes), runs it for 100 ms, logging its
    start and end as the handlers do, and records its SUCCESS. Only the lock itself can keep
    it from running beside another run of the group."""

    def __init__(self, mongo: MongoClient[Any], db: str, spare: set[str]) -> None:
        self.db = mongo[db]
        self.spare = spare
        """Keys it leaves to the workers (the scenario's own: the failing and the zombie)."""
        self.driver = SyncDriver(collections(self.db))
        self.ran = 0

    def log(self, doc: dict[str, Any], event: str) -> None:
        fields = {"key": doc["_id"], "run_id": doc["claim_run_id"], "worker_id": "believer"}
        self.db.execlog.insert_one({"_id": ObjectId(), **fields, "event": event})
        self.db.execlog.update_one(
            {"run_id": doc["claim_run_id"], "event": event}, [{"$set": {"at": "$$NOW"}}]
        )

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            found = self.db.tasks.find({"status": "pending"}, {"_id": 1})
            pending = [d["_id"] for d in found if d["_id"] not in self.spare]
            now = dt.datetime.now(dt.UTC)
            for key in pending:
                docs, _, _ = self.driver.run(
                    store.claim_locked({key: ("work", "g")}, ["work"], "believer", now)
                )
                for doc in docs:
                    self.log(doc, "start")
                    await asyncio.sleep(0.1)
                    self.log(doc, "finish")
                    outcome = Outcome(doc["_id"], doc["claim_run_id"], RunState.SUCCESS)
                    self.driver.run(store.finish_many([outcome], dt.datetime.now(dt.UTC)))
                    self.ran += 1
            await asyncio.sleep(0.05)


def publish(client: TaskClient, key: str, ms: int, **params: Any) -> None:
    options = {**LEASE, "group": "g", "max_retries": params.pop("max_retries", 5)}
    client.publish("work", key, {"ms": ms, **params}, options=options)


async def test_late_publishes_retries_a_reopened_task_and_a_zombie_never_overlap(
    cluster: Cluster, client: TaskClient, mongo: MongoClient[Any], db_name: str
) -> None:
    db = mongo[db_name]
    client.set_limit("work", group_concurrency=1)
    publish(client, "early-failed", 100, fail_attempts=1, max_retries=0)  # fails for good
    for i in range(4):
        publish(client, f"s{i}", 250, fail_attempts=1 if i in (1, 3) else 0)
    for name in ("w0", "w1"):
        cluster.spawn(name, "--concurrency", "4", "--sweep-interval", "1")
    believer, stop = Believer(mongo, db_name, {"early-failed", "zombie"}), asyncio.Event()
    believing = asyncio.create_task(believer.run(stop))
    await wait_for(lambda: (t := client.get("early-failed")) and t.status.value == "failed", 60)
    await wait_for(lambda: db.execlog.count_documents({"key": "s1", "event": "start"}) >= 1, 60)
    # late publishes while the group runs, and the early task reopened: it waits its turn
    for i in range(4, 7):
        publish(client, f"s{i}", 200)
        await asyncio.sleep(0.1)
    client.retry("early-failed")
    # a long task whose worker is frozen mid-run, past its lease; the other takes it over
    publish(client, "zombie", 4000)
    started = await wait_for(lambda: db.execlog.find_one({"key": "zombie", "event": "start"}), 90)
    frozen = started["worker_id"]
    cluster.signal(frozen, signal.SIGSTOP)
    await wait_for(lambda: db.execlog.count_documents({"key": "zombie", "event": "start"}) >= 2, 60)
    await asyncio.sleep(0.5)
    cluster.signal(frozen, signal.SIGCONT)
    publish(client, "after", 100)
    keys = {"early-failed", "zombie", "after", *(f"s{i}" for i in range(7))}
    await wait_for(
        lambda: (
            client.collection.count_documents(
                {"_id": {"$in": sorted(keys)}, "status": {"$in": ["pending", "running"]}}
            )
            == 0
        ),
        120,
    )
    # the invariants per task (the reopened one aside: an operator's retry gives it a new
    # retry budget, which I4 does not know of)
    stop.set()
    await believing
    report = check(db, keys - {"early-failed"})
    assert not report.problems, report.problems
    runs = intervals(db, keys)
    assert len(runs) >= len(keys) + 2  # the retries and the takeover are runs too
    for (_, end, first), (start, _, second) in itertools.pairwise(runs):
        assert end <= start, f"runs {first} and {second} of the group overlap"
    zombie = client.get("zombie")
    assert zombie is not None and zombie.status.value == "succeeded"
    assert zombie.runs[0].state.value == "TIMEOUT" and zombie.runs[-1].state.value == "SUCCESS"
