"""Publishing storms, handlers that hang or block the loop, skewed clocks."""

from __future__ import annotations

import asyncio
import datetime as dt
import subprocess
import sys
from typing import Any

import pytest
from harness import CHAOS, Cluster, until_finished, wait_for
from needs import missing
from sizes import Size
from test_kills import assert_invariants, work_items

from mtask import TaskClient
from mtask.errors import ConfigError
from mtask.testing import find_libfaketime

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(1800)]


def spawn_publisher(uri: str, db: str, first: int, count: int) -> subprocess.Popen[str]:
    args = [uri, db, str(first), str(count), "100"]
    return subprocess.Popen(
        [sys.executable, str(CHAOS / "publisher.py"), *args], stdout=subprocess.PIPE, text=True
    )


async def test_a_thousand_concurrent_publishes_of_a_hundred_keys(
    cluster: Cluster, client: TaskClient, mongo: Any, db_name: str, mongo_uri: str, size: Size
) -> None:
    per = 1000 // size.publishers
    procs = [spawn_publisher(mongo_uri, db_name, i * per, per) for i in range(size.publishers)]
    cluster.spawn("a", "--concurrency", "8")
    cluster.spawn("b", "--concurrency", "8")
    created = 0
    for proc in procs:
        out, _ = await asyncio.to_thread(proc.communicate, timeout=300)
        assert proc.returncode == 0
        created += int(out)
    assert created == 100  # each key created by exactly one of the 1000 publishes
    assert client.collection.count_documents({}) == 100
    await until_finished(client, 100, timeout=120, explain=cluster.explainer(client))
    report = assert_invariants(mongo, db_name, {f"p{i}" for i in range(100)})
    assert report.by_status["succeeded"] == 100
    # each ran once: one handler start a key; any other run is one claimed ahead that waited
    # over a second for a slot (a loaded machine) and was given back before its handler began
    starts = mongo[db_name]["execlog"].count_documents({"event": "start"})
    states = [r["state"] for d in mongo[db_name]["tasks"].find() for r in d["runs"]]
    assert starts == 100 and states.count("SUCCESS") == 100, (starts, states)
    assert set(states) <= {"SUCCESS", "RELEASED"}, states


async def test_hanging_handlers_are_stopped_by_cancel(
    cluster: Cluster, client: TaskClient, mongo: Any, db_name: str
) -> None:
    """A handler awaiting forever, and a plain-def one sleeping forever (which Python cannot
    stop): cancel ends both runs, and the worker's only slot is free again each time."""
    cluster.spawn("solo", "--concurrency", "1")
    options = {"worker_timeout_ms": 2000, "ping_interval_ms": 200}
    for name in ("hang", "hang_thread"):
        client.publish(name, name, options=options)
        await wait_for(lambda n=name: client.get(n).status == "running", timeout=60)  # type: ignore[union-attr, misc]
        client.cancel(name)
        await wait_for(lambda n=name: client.get(n).runs[0].state == "CANCELLED", timeout=30)  # type: ignore[union-attr, misc]
        client.publish("work", f"after-{name}", {"ms": 10})
        await wait_for(lambda n=name: client.get(f"after-{n}").status == "succeeded", timeout=30)  # type: ignore[union-attr, misc]
    log = mongo[db_name]["execlog"]
    assert log.count_documents({"key": "hang", "event": "cancelled"}) == 1
    assert log.count_documents({"key": "hang_thread", "event": {"$ne": "start"}}) == 0
    report = assert_invariants(mongo, db_name, None)
    assert report.by_status == {"cancelled": 2, "succeeded": 2}


async def test_handler_blocking_the_loop_past_its_lease(
    cluster: Cluster, client: TaskClient, mongo: Any, db_name: str
) -> None:
    """The lease is pinged from a thread, so the run keeps it although the loop is blocked
    three times longer than the worker timeout; a second worker never takes it over."""
    cluster.spawn("blocker", "--concurrency", "1")
    client.publish(
        "block_loop",
        "b",
        {"seconds": 3.0},
        options={"worker_timeout_ms": 1000, "ping_interval_ms": 200},
    )
    await wait_for(lambda: client.get("b").status == "running", timeout=60)  # type: ignore[union-attr]
    cluster.spawn("other", "--concurrency", "1")
    await until_finished(client, 1, timeout=60, explain=cluster.explainer(client))
    task = client.get("b")
    assert task is not None and task.status == "succeeded"
    assert [(r.worker_id, r.state) for r in task.runs] == [("blocker", "SUCCESS")]
    assert_invariants(mongo, db_name, {"b"})
    assert "event loop has been blocked" in cluster.log_of("blocker")


async def test_workers_with_skewed_clocks(
    cluster: Cluster, client: TaskClient, mongo: Any, db_name: str, size: Size
) -> None:
    """Host clocks 10 minutes ahead and behind (libfaketime) change nothing: every time
    decision is taken on MongoDB's clock."""
    try:
        library = str(find_libfaketime())
    except ConfigError as exc:
        missing(f"needs libfaketime (Debian: apt-get install faketime): {exc}")
    # libfaketime preloaded, not the ``faketime`` wrapper: the wrapper makes a named semaphore
    # after its PID that a killed wrapper leaves behind, and a later wrapper given the same PID
    # fails to start ("sem_open: File exists")
    for worker, offset in (("ahead", "+600s"), ("behind", "-600s")):
        skewed = {"LD_PRELOAD": library, "FAKETIME": offset, "FAKETIME_DONT_FAKE_MONOTONIC": "1"}
        cluster.spawn(worker, "--concurrency", "8", env=skewed)
    cluster.spawn("true", "--concurrency", "8")
    # leases long enough that none runs out on a loaded machine: any TIMEOUT would be a
    # worker whose clock made it take a live lease for an expired one
    items = work_items(size.tasks // 2, seed=6, worker_timeout_ms=5000, ping_interval_ms=300)
    client.publish_many(items)
    for i in range(20):  # ahead of the backlog when due (priority), not before (run_at)
        client.publish("work", f"delayed{i}", {"ms": 10}, delay=0.5, options={"priority": 10})
    await until_finished(
        client, len(items) + 20, timeout=120 + size.tasks / 5, explain=cluster.explainer(client)
    )
    keys = {i["key"] for i in items} | {f"delayed{i}" for i in range(20)}
    report = assert_invariants(mongo, db_name, keys)
    assert report.by_status["succeeded"] == len(keys)
    workers = {r.worker_id for t in client.list(limit=1000) for r in t.runs}
    assert workers == {"ahead", "behind", "true"}
    for i in range(20):
        task = client.get(f"delayed{i}")
        assert task is not None and task.options.run_at is not None
        claimed = task.runs[0].claimed_at
        # never before it is due; and not a skew late (a clock 10 minutes behind would wait
        # 600 s): the bound is far below the skew, far above a loaded machine's delay
        assert task.options.run_at <= claimed < task.options.run_at + dt.timedelta(seconds=60)
    timed_out = [
        (t["_id"], r.get("worker_id"), r.get("claimed_at"), r.get("lease_expires_at"), r)
        for t in mongo[db_name]["tasks"].find({"runs.state": "TIMEOUT"})
        for r in t["runs"]
    ]
    assert report.timeouts == 0, timed_out  # no worker took a live lease for an expired one
