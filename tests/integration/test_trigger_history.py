"""A trigger whose history is lost (docs/triggers.md): while no worker follows it, a tiny oplog
(1 MiB, checkpointed every second) is overrun past its stored position. The next follower says
so (a warning, ``mtask_follower_history_lost_total``, ``lost`` in its document) and scans: every
document that matches now gets a task; none is lost in silence."""

from __future__ import annotations

import contextlib
import logging
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import running_worker, wait_for
from prometheus_client import REGISTRY
from pymongo import MongoClient
from pymongo.errors import OperationFailure, PyMongoError

from mtask.embedded import find_mongod, free_port
from mtask.follow.events import HISTORY_LOST
from mtask.registry import Registry

registry = Registry()
registry.task("ship")(lambda params: None)
registry.task("idle")(lambda params: None)
registry.trigger("orders", task="ship", match={"status": "paid"})


@pytest.fixture
def tiny_oplog(tmp_path: Path) -> Iterator[str]:
    """A one-member replica set of its own whose oplog holds 1 MiB and is truncated within a
    second or two of being overrun (``--syncdelay 1``: a checkpoint a second)."""
    port = free_port()
    proc = subprocess.Popen(
        [
            str(find_mongod()), "--replSet", "tiny", "--dbpath", str(tmp_path), "--port",
            str(port), "--bind_ip", "127.0.0.1", "--oplogSize", "1", "--syncdelay", "1",
            "--wiredTigerCacheSizeGB", "0.25", "--setParameter",
            "diagnosticDataCollectionEnabled=false", "--logpath", str(tmp_path / "mongod.log"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    direct: MongoClient[dict[str, Any]] = MongoClient(
        f"mongodb://127.0.0.1:{port}/?directConnection=true", serverSelectionTimeoutMS=30_000
    )
    try:
        direct.admin.command("ping")
        members = [{"_id": 0, "host": f"127.0.0.1:{port}"}]
        direct.admin.command("replSetInitiate", {"_id": "tiny", "members": members})
        uri = f"mongodb://127.0.0.1:{port}/?replicaSet=tiny"
        with MongoClient(uri, serverSelectionTimeoutMS=60_000) as ready:
            ready.admin.command("ping")
        yield uri
    finally:
        direct.close()
        proc.terminate()
        proc.wait(timeout=60)


def _resumable(db: Any, token: dict[str, Any]) -> bool:
    try:
        with db.orders.watch(resume_after=token) as stream:
            stream.try_next()
    except OperationFailure as exc:
        if exc.code in HISTORY_LOST:
            return False
        raise
    return True


def _lost_count() -> float:
    value = REGISTRY.get_sample_value(
        "mtask_follower_history_lost_total", {"follower": "trigger:ship"}
    )
    return value or 0.0


async def test_a_lost_history_is_said_and_scanned_never_silently_lost(
    tiny_oplog: str, caplog: pytest.LogCaptureFixture
) -> None:
    mongo: MongoClient[dict[str, Any]] = MongoClient(tiny_oplog, tz_aware=True)
    db = mongo["history"]
    async with running_worker(registry, tiny_oplog, "history", names=["idle"]) as (_, events):
        await events.wait("following", follower="trigger:ship")
        db.orders.insert_one({"_id": "before", "status": "paid"})
        await wait_for(lambda: db.tasks.find_one({"params._id": "before"}))
    token = db.triggers.find_one({"_id": "tasks/trigger/ship"})["token"]
    # while nobody follows: a change that matches, one that does not, and the oplog overrun
    db.orders.insert_one({"_id": "while-away", "status": "paid"})
    db.orders.insert_one({"_id": "unpaid", "status": "new"})
    deadline = time.monotonic() + 120
    while _resumable(db, token):
        assert time.monotonic() < deadline, "the oplog was not overrun"
        db.filler.insert_many([{"p": "x" * 10_000} for _ in range(100)])
        with contextlib.suppress(PyMongoError):  # a checkpoint now: the truncation follows
            mongo.admin.command("fsync")
    before = _lost_count()
    caplog.set_level(logging.WARNING, logger="mtask.worker.reacting.follower")
    async with running_worker(registry, tiny_oplog, "history", names=["idle"]) as (_, events):
        lost = await events.wait("history_lost", follower="trigger:ship", timeout=60)
        scanned = await events.wait("scanned", follower="trigger:ship", timeout=60)
        db.orders.insert_one({"_id": "after", "status": "paid"})
        await wait_for(lambda: db.tasks.find_one({"params._id": "after"}), timeout=30)
    assert "history" in lost["reason"] or "resume" in lost["reason"].lower()
    assert scanned["published"] == 2  # before and while-away, as they are now
    scans = {t["params"]["_id"] for t in db.tasks.find({"params.change.op": "scan"})}
    assert scans == {"before", "while-away"}
    assert db.tasks.find_one({"params._id": "unpaid"}) is None
    assert _lost_count() == before + 1
    state = db.triggers.find_one({"_id": "tasks/trigger/ship"})
    assert state["lost"] == 1 and state["lost_at"] is not None and state["scan"]["done"]
    warned = [r for r in caplog.records if "history after its position is lost" in r.getMessage()]
    assert warned and warned[0].levelno == logging.WARNING
    mongo.close()
