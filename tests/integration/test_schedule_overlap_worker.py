"""A schedule's overlap policy, fired by a real worker process: ``skip`` publishes
no tick while the previous task runs and counts them; ``buffer`` holds one and publishes it
once the previous task finished; ``all`` lets them pile up; ``mtask schedule list`` shows it."""

from __future__ import annotations

from typing import Any

import pytest
from harness import run_cli
from pymongo import MongoClient
from test_snooze_worker import flow_worker, polled

from mtask import TaskClient
from mtask.errors import InvalidTask
from mtask.schedules.ticks import tick_key

FAST = {"ping_interval_ms": 100}


def ticks_of(mongo: MongoClient[dict[str, Any]], db: str, sid: str) -> list[dict[str, Any]]:
    found = mongo[db]["tasks"].find({"_id": {"$regex": f"^{sid}@"}}).sort("_id", 1)
    return list(found)


def schedule(mongo: MongoClient[dict[str, Any]], db: str, sid: str) -> dict[str, Any]:
    return mongo[db]["schedules"].find_one({"_id": sid}) or {}


def listed(mongo_uri: str, db: str) -> tuple[int, str]:
    """``mtask schedule list``'s exit code and output."""
    code, out, _ = run_cli("schedule", "list", "--uri", mongo_uri, "--database", db, width=160)
    return code, out


def remove_and_cancel(
    client: TaskClient, mongo: MongoClient[dict[str, Any]], db: str, sid: str
) -> None:
    """The schedule removed and its ticks still pending or running cancelled (the worker
    stops with nothing left running)."""
    client.remove_schedule(sid)
    for task in ticks_of(mongo, db, sid):
        if task["status"] in ("pending", "running"):
            client.cancel(task["_id"])


def test_skip_publishes_nothing_while_the_previous_runs(
    mongo_uri: str, db_name: str, client: TaskClient, mongo: MongoClient[dict[str, Any]]
) -> None:
    client.add_schedule("sk", "hold", every=0.2, options=FAST, overlap="skip")
    with flow_worker(mongo_uri, db_name):
        polled(lambda: schedule(mongo, db_name, "sk"), lambda d: d.get("skipped", 0) >= 5)
        running = ticks_of(mongo, db_name, "sk")
        assert len(running) == 1  # five ticks came, the first still runs
        code, out = listed(mongo_uri, db_name)
        assert code == 0 and "skip, " in out and " skipped" in out
        client.cancel(running[0]["_id"])
        after = polled(lambda: ticks_of(mongo, db_name, "sk"), lambda t: len(t) >= 2)
        assert len(after) >= 2  # once it ended, the next tick is published
        remove_and_cancel(client, mongo, db_name, "sk")


def test_buffer_holds_one_tick_and_publishes_it_after_the_previous(
    mongo_uri: str, db_name: str, client: TaskClient, mongo: MongoClient[dict[str, Any]]
) -> None:
    client.add_schedule("bf", "hold", every=0.2, options=FAST, overlap="buffer")
    with flow_worker(mongo_uri, db_name):
        held = polled(
            lambda: schedule(mongo, db_name, "bf"),
            lambda d: d.get("buffered_tick") is not None and d.get("skipped", 0) >= 3,
        )
        assert held.get("buffered_tick") is not None
        (first,) = ticks_of(mongo, db_name, "bf")
        code, out = listed(mongo_uri, db_name)
        assert code == 0 and "buffer" in out and "1 buffered" in out
        client.pause_schedule("bf")  # no newer tick: the held one is the next task
        buffered = schedule(mongo, db_name, "bf")["buffered_tick"]
        client.resume_schedule("bf")
        client.cancel(first["_id"])
        after = polled(lambda: ticks_of(mongo, db_name, "bf"), lambda t: len(t) >= 2)
        keys = [t["_id"] for t in after]
        assert len(after) >= 2 and tick_key("bf", buffered) in keys[:3]
        remove_and_cancel(client, mongo, db_name, "bf")


def test_all_lets_ticks_overlap(
    mongo_uri: str, db_name: str, client: TaskClient, mongo: MongoClient[dict[str, Any]]
) -> None:
    client.add_schedule("al", "hold", every=0.2, options=FAST)
    with flow_worker(mongo_uri, db_name):
        piled = polled(
            lambda: [t for t in ticks_of(mongo, db_name, "al") if t["status"] == "running"],
            lambda running: len(running) >= 2,
        )
        assert len(piled) >= 2
        remove_and_cancel(client, mongo, db_name, "al")


def test_a_bad_overlap_is_refused(mongo_uri: str, db_name: str, client: TaskClient) -> None:
    with pytest.raises(InvalidTask) as caught:
        client.add_schedule("x", "hold", every=1, overlap="queue")
    assert caught.value.field == "overlap"
    with pytest.raises(SystemExit) as refused:
        run_cli("schedule", "add", "x", "hold", "--every", "1", "--overlap", "queue",
                "--uri", mongo_uri, "--database", db_name)  # fmt: skip
    assert refused.value.code == 2
