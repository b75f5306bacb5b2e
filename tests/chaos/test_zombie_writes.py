"""A zombie's writes reach MongoDB and are refused there (promises with teeth).

The worker's own clock usually stops a run that lost its lease before it writes anything
(``test_kills``' frozen worker records nothing), so the server's fence is never reached by it.
Here the server holds the zombie's writes instead: a fail point (``failCommand`` with
``blockConnection``) keeps every command of the worker whose ``appName`` is ``zombie`` waiting
for a few seconds, its lease pings included. Its lease runs out, a second worker takes the task
over and finishes it, and only then do the zombie's held writes run: its outcome, its step's
record and its output (its log line, or the record of its output's session that comes first).
Each reaches the server (the profiler shows it, with the zombie's ``appName``) and matches
nothing, and the task holds the rescuer's work alone."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from harness import Cluster, ReplicaSet, wait_for
from pymongo import MongoClient

from mtask import TaskClient

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(300)]

HOLD_MS = 6000
"""How long the server holds each of the zombie's commands: past its lease (1 s) and the
rescuer's whole run."""
LEASE = {"worker_timeout_ms": 1000, "ping_interval_ms": 200, "max_retries": 3}
COMMANDS = ["findAndModify", "update", "insert", "commitTransaction", "abortTransaction"]


def with_app(uri: str, app: str) -> str:
    return f"{uri}{'&' if '?' in uri else '?'}appName={app}"


@contextlib.asynccontextmanager
async def zombie_then_rescuer(
    tmp_path: Path, name: str, key: str
) -> AsyncIterator[tuple[Any, Any, str]]:
    """Run task ``key`` of ``name`` on a zombie and then a rescuer; yields the database,
    the task's document and the zombie's run id."""
    replica_set = ReplicaSet(tmp_path / "rs", members=1, test_commands=True)
    uri = replica_set.start()
    mongo: MongoClient[dict[str, Any]] = MongoClient(uri, tz_aware=True)
    db = mongo["zombie"]
    db.command("profile", 2)  # every operation, with its appName and what it matched
    side = {"CHAOS_URI": uri}  # the handlers' own writes are never held
    zombie = Cluster(with_app(uri, "zombie"), "zombie", tmp_path)
    rescuer = Cluster(with_app(uri, "rescuer"), "zombie", tmp_path)
    try:
        with TaskClient(uri, database="zombie") as client:
            client.publish(name, key, {}, options=LEASE)
            zombie.spawn("zombie", "--sweep-interval", "1", env=side)
            started = await wait_for(lambda: db.execlog.find_one({"key": key, "event": "start"}))
            zombie_run = started["run_id"]
            replica_set.fail_point(
                replica_set.ports[0],
                "failCommand",
                failCommands=COMMANDS,
                appName="zombie",
                blockConnection=True,
                blockTimeMS=HOLD_MS,
            )
            db.armed.insert_one({"_id": "armed"})
            rescuer.spawn("rescuer", "--sweep-interval", "1", env=side)
            # the rescuer runs the task; the zombie's held commands run meanwhile, and match
            # nothing; then the rescuer finishes
            await wait_for(lambda: held_writes(db, key, zombie_run), HOLD_MS / 1000 + 30)
            await asyncio.sleep(1.0)  # the rest of them land too
            db.armed.insert_one({"_id": "released"})
            done = await wait_for(
                lambda: (t := client.get(key)) is not None and t.status.value == "succeeded", 60
            )
            assert done
            replica_set.fail_point(replica_set.ports[0], "failCommand", mode="off")
            yield db, db.tasks.find_one({"_id": key}), zombie_run
    finally:
        zombie.close()
        rescuer.close()
        mongo.close()
        replica_set.stop()


def held_writes(db: Any, key: str, run_id: str) -> list[dict[str, Any]]:
    """The zombie's writes of the tasks collection naming its run that the server ran after
    the rescuer had claimed the task: those it held."""
    task = db.tasks.find_one({"_id": key}, {"runs": 1})
    rescued = [r["claimed_at"] for r in (task or {}).get("runs", []) if r["run_id"] != run_id]
    if not rescued:
        return []
    return [
        p
        for p in db.system.profile.find(
            {"appName": "zombie", "ns": "zombie.tasks", "ts": {"$gt": rescued[0]}}
        )
        if run_id in str(p.get("command", {})) and p.get("op") in ("update", "command")
    ]


async def test_a_zombies_outcome_reaches_mongodb_and_is_refused(tmp_path: Path) -> None:
    async with zombie_then_rescuer(tmp_path, "zombie_outcome", "z-out") as (db, task, zombie_run):
        held = held_writes(db, "z-out", zombie_run)
    assert task["result"] == {"by": "rescuer"}
    runs = {r["run_id"]: r for r in task["runs"]}
    assert runs[zombie_run]["state"] != "SUCCESS" and runs[zombie_run].get("result") is None
    assert [r["state"] for r in task["runs"] if r["run_id"] != zombie_run] == ["SUCCESS"]
    outcome = [p for p in held if p.get("op") == "update" and "SUCCESS" in str(p["command"])]
    assert outcome, held  # the zombie's SUCCESS reached the server...
    assert all(p.get("nMatched") == 0 and p.get("nModified") == 0 for p in outcome)  # ...and missed


async def test_a_zombies_step_record_and_output_reach_mongodb_and_are_refused(
    tmp_path: Path,
) -> None:
    async with zombie_then_rescuer(tmp_path, "zombie_steps", "z-steps") as (db, task, zombie_run):
        lines = list(db["tasks.output"].find({"task": "z-steps"}))
        effects = [e["run_id"] for e in db.effects.find({"key": "z-steps", "what": "second"})]
        held = held_writes(db, "z-steps", zombie_run)
    assert task["result"]["by"] == "rescuer"
    second = next(s for s in task["steps"] if s["name"] == "second")
    assert second["run_id"] != zombie_run and second["result"] == "second by rescuer"
    assert [line["fields"]["worker"] for line in lines] == ["rescuer"]
    assert all(line["run_id"] != zombie_run for line in lines)
    # the zombie's step ran (its effect is there) but its record was refused by the server
    assert zombie_run in effects
    step_writes = [p for p in held if "steps" in str(p["command"])]
    # its output's: the record of its output session (before its first line), or a line's
    output = ("output_txn", "output_batch")
    output_writes = [p for p in held if any(f in str(p["command"]) for f in output)]
    assert step_writes and output_writes, held
    for p in step_writes + output_writes:
        assert p.get("nMatched", 0) == 0 and p.get("nModified", 0) == 0, p
