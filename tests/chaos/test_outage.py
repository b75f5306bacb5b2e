"""A whole-cluster outage: every member of the replica set killed with SIGKILL at
once while tasks flow, then started again. Nothing acknowledged is lost, and the workers
recover by themselves."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from harness import Cluster, replica_set_with_workers, until_finished, wait_for
from pymongo import MongoClient
from sizes import Size
from test_kills import assert_invariants, work_items

from mtask import TaskClient

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(900)]

LEASE = {"worker_timeout_ms": 5000, "ping_interval_ms": 500}
DOWN = 3.0
"""Seconds every member stays down."""
RECOVERY = 60.0
"""How long a worker may take to run a new task once the set has a primary again."""


class Publishers:
    """Threads publishing ``items`` in order, paced, each publish w=majority (the client's
    write concern), the first ``limit`` of them until it is raised. A key is *acknowledged*
    once a publish of it returned; one that raised is published again (publishing is
    idempotent by key) until it is acknowledged or the publishers stop."""

    def __init__(self, client: TaskClient, items: list[dict[str, Any]], threads: int) -> None:
        self.client = client
        self.items = items
        self.next = 0
        self.limit = len(items)
        self.acked: list[str] = []
        self.errors = 0
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    def _run(self) -> None:
        while not self.stopping.is_set():
            with self.lock:
                if self.next == len(self.items):
                    return
                if self.next == self.limit:
                    item = None
                else:
                    item, self.next = self.items[self.next], self.next + 1
            if item is None:
                self.stopping.wait(0.05)
                continue
            while True:
                try:
                    self.client.publish(
                        item["name"], item["key"], item["params"], options=item["options"]
                    )
                except Exception:  # noqa: BLE001 - MongoDB is down or electing: again
                    with self.lock:
                        self.errors += 1
                    if self.stopping.wait(0.2):
                        return  # not acknowledged: it may or may not exist
                    continue
                with self.lock:
                    self.acked.append(item["key"])
                break
            self.stopping.wait(0.05)  # a flow, not a burst

    def done(self) -> bool:
        return not any(thread.is_alive() for thread in self.threads)

    def stop(self) -> None:
        self.stopping.set()
        for thread in self.threads:
            thread.join(timeout=60)
        assert self.done()


def outcome_of(mongo: MongoClient[dict[str, Any]], db: str, key: str) -> str | None:
    try:
        doc = mongo[db]["tasks"].find_one({"_id": key}, {"status": 1})
    except Exception:  # noqa: BLE001 - asked again
        return None
    return None if doc is None else str(doc["status"])


def published(client: TaskClient, key: str, options: dict[str, Any]) -> bool:
    try:
        client.publish("work", key, {"ms": 10}, options=options)
    except Exception:  # noqa: BLE001 - published again
        return False
    return True


async def probe(
    client: TaskClient,
    mongo: MongoClient[dict[str, Any]],
    db: str,
    cluster: Cluster,
    workers: list[str],
    tag: str,
) -> None:
    """A new task for each worker (only it may run it, ahead of any backlog) runs within
    ``RECOVERY`` seconds; if one does not, the failure shows its document and its worker's
    last log lines."""
    options = {"priority": 100, **LEASE}
    for name in workers:
        key = f"{tag}-{name}"
        only = {**options, "specific_worker_ids": [name]}
        # (the client may not have found the new primary yet: a publish may fail at first)
        await wait_for(lambda k=key, o=only: published(client, k, o), RECOVERY, 0.5)  # type: ignore[misc]
    for name in workers:
        key = f"{tag}-{name}"
        try:
            await wait_for(lambda k=key: outcome_of(mongo, db, k) == "succeeded", RECOVERY, 0.1)  # type: ignore[misc]
        except TimeoutError:
            doc = mongo[db]["tasks"].find_one({"_id": key}, {"params": 0})
            raise AssertionError((key, doc, cluster.log_of(name)[-3000:])) from None


async def test_whole_replica_set_killed_and_restarted_under_load(
    tmp_path: Path, db_name: str, size: Size
) -> None:
    replica_set, cluster = await replica_set_with_workers(tmp_path, db_name)
    uri = cluster.uri
    workers = ["own", "shared"]
    common = ("--concurrency", "8", "--sweep-interval", "2")
    items = work_items(size.tasks, seed=27, **LEASE)
    outages = max(1, size.restarts)
    try:
        with (
            TaskClient(uri, database=db_name) as client,
            MongoClient(uri, tz_aware=True) as mongo,
        ):
            cluster.spawn("own", *common, "--stream", "own")
            cluster.spawn("shared", *common)
            pids = {name: cluster.procs[name].pid for name in workers}
            await wait_for(lambda: len(client.workers()) == 2, timeout=60)
            # publishers give up on a publish after 1 s without a primary (the default waits
            # 10 s, through the whole outage): they meet it, and publish again
            quick = TaskClient(f"{uri}&serverSelectionTimeoutMS=1000", database=db_name)
            publishers = Publishers(quick, items, size.publishers)
            # one phase of publishing per outage, and one after the last: each outage comes
            # half-way through its phase, and the next phase begins once the set is back
            phases = [len(items) * (n + 1) // (outages + 1) for n in range(outages + 1)]
            publishers.limit = phases[0]
            publishers.start()
            downtimes = []
            try:
                for n in range(outages):
                    # while tasks flow: some acknowledged (and more to come), some finished
                    mark = (phases[n] + (phases[n - 1] if n else 0)) // 2
                    await wait_for(lambda m=mark: len(publishers.acked) >= m, timeout=120)  # type: ignore[misc]
                    await wait_for(
                        lambda: mongo[db_name]["execlog"].count_documents({"event": "finish"}),
                        timeout=120,
                    )
                    before = time.monotonic()
                    await asyncio.to_thread(replica_set.kill_all)
                    await asyncio.sleep(DOWN)
                    await asyncio.to_thread(replica_set.restart_all)
                    downtimes.append(time.monotonic() - before)
                    assert len(publishers.acked) <= phases[n]
                    publishers.limit = phases[n + 1]
                    # each worker runs a new task soon after the set is back
                    await probe(client, mongo, db_name, cluster, workers, f"back{n}")
                    print(f"outage {n}: {downtimes[-1]:.1f}s; {publishers.errors} failed publishes")
                await wait_for(publishers.done, timeout=120 + size.tasks / 5)
            finally:
                publishers.stop()
                quick.close()
            acked = set(publishers.acked)
            assert acked == {i["key"] for i in items}  # none given up on
            assert publishers.errors > 0  # publishing did meet the outage
            probes = {f"{t}-{w}" for t in [f"back{n}" for n in range(outages)] for w in workers}
            try:
                await until_finished(
                    client,
                    len(acked) + len(probes),
                    timeout=120 + size.tasks / 5,
                    explain=cluster.explainer(client),
                )
            except AssertionError:
                for doc in client.collection.find(
                    {"status": {"$in": ["pending", "running"]}}, {"params": 0}
                ).limit(3):
                    print("OPEN", doc)
                for name in workers:
                    print(name, cluster.procs[name].poll(), cluster.log_of(name)[-3000:])
                raise
            # nothing acknowledged is lost, and every run kept to the invariants
            report = assert_invariants(mongo, db_name, acked | probes)
            print(f"{report.runs} runs, {report.timeouts} timed out (leases run out meanwhile)")
            assert report.by_status["succeeded"] == len(acked | probes)
            # the workers rode it out: the same processes, nothing in them died
            for name in workers:
                proc, log = cluster.procs[name], cluster.log_of(name)
                assert proc.pid == pids[name] and proc.poll() is None, (name, log[-3000:])
                assert "died" not in log and "stopping the worker" not in log, (name, log[-3000:])
            # and a task published now still runs within the bound
            await probe(client, mongo, db_name, cluster, workers, "after")
    finally:
        cluster.close()
        replica_set.stop()
