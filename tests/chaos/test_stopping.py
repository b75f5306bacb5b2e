"""A worker told to stop (SIGTERM) exits within its bounds: a handler that will not end and a
MongoDB frozen (SIGSTOP) or gone do not hold it; a second signal ends the waits at once."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import Cluster, ReplicaSet, wait_for
from pymongo import MongoClient

from mtask import TaskClient
from mtask.worker import DRAIN_WRITE_TIMEOUT, IMMEDIATE_STOP_TIMEOUT
from mtask.worker.running.invoke import ASYNC_CANCEL_GRACE

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(600)]

SLACK = 30.0
"""What a bound below allows beyond the worker's own settings (start-up, a loaded host)."""


async def exits_within(cluster: Cluster, proc: subprocess.Popen[bytes], seconds: float) -> int:
    try:
        return await asyncio.to_thread(proc.wait, seconds)
    except subprocess.TimeoutExpired:
        raise AssertionError(
            f"the worker still runs {seconds:g}s after its stop; its log:\n{cluster.log_of('w')}"
        ) from None


async def started(log: Any, worker_id: str) -> None:
    await wait_for(lambda: log.count_documents({"worker_id": worker_id, "event": "start"}), 60)


@pytest.mark.parametrize("signals", [1, 2])
async def test_a_handler_that_swallows_its_cancel_does_not_hold_the_stop(
    cluster: Cluster, client: TaskClient, mongo: MongoClient[dict[str, Any]], db_name: str,
    signals: int,
) -> None:  # fmt: skip
    """Its run is left behind (nothing recorded: its lease runs out); the process exits, after
    the drain (one signal) or at once (two: the grace is far longer than the bound)."""
    grace = 2.0 if signals == 1 else 600.0
    client.publish("stubborn", "s", {}, options={"max_retries": 0})
    proc = cluster.spawn("w", "--grace", str(grace))
    await started(mongo[db_name]["execlog"], "w")
    cluster.signal("w", signal.SIGTERM)
    if signals == 2:  # once the first is handled (two at once may arrive as one)
        await wait_for(lambda: "stopping immediate=False" in cluster.log_of("w"), SLACK)
        cluster.signal("w", signal.SIGTERM)
    bound = (grace if signals == 1 else 0) + ASYNC_CANCEL_GRACE + SLACK
    assert await exits_within(cluster, proc, bound) == 0
    said = cluster.log_of("w")
    task = client.get("s")
    assert task is not None
    assert "did not end within" in said and task.runs[-1].run_id[:8] in said, said
    assert task.status == "running" and task.runs[-1].state == "RUNNING"  # nothing recorded


@pytest.fixture
def own_mongod(tmp_path: Path) -> Iterator[ReplicaSet]:
    """A mongod of the test's own, to freeze and kill."""
    servers = ReplicaSet(tmp_path / "rs", members=1)
    servers.start()
    try:
        yield servers
    finally:
        for pid in servers.pids.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        servers.stop()


@pytest.mark.parametrize("fault", ["frozen", "frozen, a second signal", "gone"])
async def test_a_worker_stops_with_mongodb_out_of_reach(
    own_mongod: ReplicaSet, tmp_path: Path, db_name: str, fault: str
) -> None:
    uri = own_mongod.uri
    grace = 1.0
    cluster = Cluster(uri, db_name, tmp_path)
    try:
        with TaskClient(uri, database=db_name) as client:
            client.publish("hang", "h", {})
        proc = cluster.spawn("w", "--grace", str(grace))
        direct: MongoClient[dict[str, Any]] = MongoClient(uri)
        try:
            await started(direct[db_name]["execlog"], "w")
        finally:
            direct.close()
        [pid] = own_mongod.pids.values()
        if fault == "gone":
            own_mongod.kill_all()
        else:
            os.kill(pid, signal.SIGSTOP)
        cluster.signal("w", signal.SIGTERM)
        # the run's handler, cancelled, cannot log its end: it is left behind
        if fault == "frozen, a second signal":
            await wait_for(lambda: "stopping immediate=False" in cluster.log_of("w"), SLACK)
            cluster.signal("w", signal.SIGTERM)
            bound = ASYNC_CANCEL_GRACE + IMMEDIATE_STOP_TIMEOUT + SLACK
        else:
            bound = grace + ASYNC_CANCEL_GRACE + DRAIN_WRITE_TIMEOUT + SLACK
        assert await exits_within(cluster, proc, bound) == 0, cluster.log_of("w")
    finally:
        cluster.close()
