"""The relay's holder killed or frozen while MongoDB's primary fails over.

A three-member replica set; three workers sharing the stream, the sweep off (what finds the
work is the relay and its standby alone). The primary mongod and the relay's holder are killed
(or the holder frozen) at the same moment, while tasks are published: the standby takes the
lease over once a primary is elected again (its tries fail meanwhile, its post may lapse and is
taken again), the tasks published across both faults are claimed by live workers while the
holder is still away, each run to one success, nothing lost or stranded, no zombie write."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any

import pytest
from harness import replica_set_with_workers, until_finished, wait_for
from pymongo import MongoClient
from test_kills import assert_invariants
from test_partition import (
    Publisher,
    first_claimers,
    relay_and_standby,
    relay_host,
    until_some_finished,
)

from mtask import TaskClient

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(900)]

WORKERS = ("a", "b", "c")


@pytest.mark.parametrize("fault", ["killed", "frozen"])
async def test_the_relays_holder_lost_while_the_primary_fails_over(
    tmp_path: Path, db_name: str, fault: str
) -> None:
    replica_set, cluster = await replica_set_with_workers(tmp_path, db_name)
    uri = cluster.uri
    publisher: Publisher | None = None
    frozen: str | None = None
    try:
        for name in WORKERS:
            cluster.spawn(name, "--concurrency", "4", "--sweep-interval", "3600")
        with (
            TaskClient(uri, database=db_name) as client,
            MongoClient(uri, tz_aware=True) as mongo,
        ):
            await wait_for(lambda: len(client.workers()) == len(WORKERS), timeout=60)
            holder, standby = await relay_and_standby(mongo, db_name)
            assert holder is not None and standby not in (None, holder), standby
            publisher = Publisher(uri, db_name, every=0.1)
            publisher.start()
            await asyncio.sleep(1.0)
            primary = await asyncio.to_thread(replica_set.wait_primary)
            os.kill(replica_set.pids.pop(primary), signal.SIGKILL)  # the primary, and at once
            cluster.signal(holder, signal.SIGKILL if fault == "killed" else signal.SIGSTOP)
            frozen = holder if fault == "frozen" else None
            began = len(publisher.keys)  # published from now on: the holder cannot claim them
            await asyncio.to_thread(replica_set.wait_primary, 60, primary)
            successor = await wait_for(
                lambda: (r := _holder(mongo, db_name)) not in (None, holder) and r, timeout=90
            )
            assert successor == standby, (holder, standby, successor)  # the standby took over
            await asyncio.sleep(1.0)
            during = publisher.keys[began:]
            await wait_for(
                lambda: len(first_claimers(client, during)) == len(during), timeout=90
            )  # by live workers, the holder still away, the sweep off
            assert holder not in first_claimers(client, during).values()
            if frozen is not None:
                cluster.signal(frozen, signal.SIGCONT)
                frozen = None
            keys = publisher.stop()
            publisher = None
            await until_some_finished(client, during, timeout=120)
            await until_finished(client, len(keys), timeout=180, explain=cluster.explainer(client))
            report = assert_invariants(mongo, db_name, set(keys))
            assert report.by_status["succeeded"] == len(keys)
            for worker_id, proc in cluster.procs.items():
                assert proc.poll() is None, (worker_id, cluster.log_of(worker_id)[-2000:])
    finally:
        if publisher is not None:
            publisher.stop()
        if frozen is not None:
            cluster.signal(frozen, signal.SIGCONT)
        cluster.close()
        replica_set.stop()


def _holder(mongo: MongoClient[dict[str, Any]], db: str) -> str | None:
    """The relay's host, or ``None`` while MongoDB has no primary."""
    try:
        return relay_host(mongo, db)
    except Exception:  # noqa: BLE001 - failing over: asked again
        return None
