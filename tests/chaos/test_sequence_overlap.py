"""A sequence never overlaps, whatever kind of handler: a run told to stop — its
task cancelled, its time limit passed — whose plain-def handler cannot be stopped keeps its
group's lock (and a group's slot, with ``group_concurrency`` above 1) until its thread has
really returned, says so, and only then may the group's next run start. Times are the
handlers' own (``execlog``, on the server's clock), never the documents'."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from harness import Cluster, wait_for
from pymongo import MongoClient

from mtask import TaskClient
from mtask.store.schema import LOCK_STATUSES

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(300)]

OPTIONS = {"worker_timeout_ms": 3000, "ping_interval_ms": 300, "retry_delay_ms": 0}


def spans(db: Any) -> dict[str, list[tuple[dt.datetime, dt.datetime | None]]]:
    """Per task, each run's thread: (its start, its end or None), by the server's clock."""
    runs: dict[str, dict[str, list[dt.datetime | None]]] = {}
    for entry in db.execlog.find().sort("at", 1):
        at = runs.setdefault(entry["key"], {}).setdefault(entry["run_id"], [None, None])
        at[0 if entry["event"] == "start" else 1] = entry["at"]
    return {k: [(s, e) for s, e in v.values() if s is not None] for k, v in runs.items()}


def peak(db: Any) -> int:
    """The most threads of the group running at once, from their own start and end."""
    edges = sorted(
        (t, d)
        for runs in spans(db).values()
        for start, end in runs
        for t, d in ((start, 1), (end or dt.datetime.max.replace(tzinfo=dt.UTC), -1))
    )
    running = most = 0
    for _, d in edges:  # an end before a start at the same instant: sorted (t, -1) first
        running += d
        most = max(most, running)
    return most


def ended(db: Any, key: str) -> bool:
    return all(end is not None for _, end in spans(db).get(key, [])) and key in spans(db)


async def run_group(
    cluster: Cluster, client: TaskClient, db: Any, group_concurrency: int, stop: str
) -> None:
    client.set_limit("seq_thread", group_concurrency=group_concurrency)
    tasks = group_concurrency + 1
    params = {"ms": 4000} if stop == "cancel" else {"ms_by_attempt": {"1": 4000}}
    client.publish("seq_thread", "first", params, options={**OPTIONS, "group": "g"})
    for i in range(1, tasks):
        client.publish("seq_thread", f"next{i}", {"ms": 300}, options={**OPTIONS, "group": "g"})
    for name in ("w1", "w2"):
        cluster.spawn(name, "--concurrency", "4", "--sweep-interval", "1")
    await wait_for(lambda: "first" in spans(db), 60)
    if stop == "cancel":
        client.cancel("first")
    # every task's last thread has returned, and nothing is open
    await wait_for(
        lambda: (
            all(ended(db, k) for k in ["first", *[f"next{i}" for i in range(1, tasks)]])
            and client.collection.count_documents({"status": {"$in": ["pending", "running"]}}) == 0
        ),
        90,
    )


@pytest.mark.parametrize("stop", ["cancel", "time_limit"])
@pytest.mark.parametrize("group_concurrency", [1, 2])
async def test_a_run_that_cannot_be_stopped_keeps_its_group_until_its_thread_returns(
    cluster: Cluster,
    client: TaskClient,
    mongo: MongoClient[Any],
    db_name: str,
    stop: str,
    group_concurrency: int,
) -> None:
    db = mongo[db_name]
    await run_group(cluster, client, db, group_concurrency, stop)
    assert peak(db) <= group_concurrency, spans(db)
    first = client.get("first")
    assert first is not None
    if stop == "cancel":
        assert first.status.value == "cancelled"
        assert [r.state.value for r in first.runs] == ["CANCELLED"]
    else:  # its retry, too, waited for its own thread (it is a task of the group)
        assert [r.state.value for r in first.runs] == ["FAIL", "SUCCESS"]
        assert "held its lock and slots until it returned" in (first.runs[0].error or "")
    logs = cluster.log_of("w1") + cluster.log_of("w2")
    assert "was told to stop, but its handler goes on" in logs  # it says so
    held = {"group_lock": True, "status": {"$in": LOCK_STATUSES}}  # what sequence_lock counts
    assert client.collection.count_documents(held) == 0  # given up once it had stopped
