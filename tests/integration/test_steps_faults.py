"""Durable steps under faults, with real worker processes (``workerapp``): a worker
killed with SIGKILL between steps (its handler on the event loop, or in a child process:
``poolhandlers``) or mid-chain of continues as new, a worker frozen inside a step past its
lease and then resumed, and the primary of a three-member replica set killed while a
transactional step is in flight. Side effects are counted in the test's database, never
inferred from the task document."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from harness import ReplicaSet, dead, wait_for, worker_process
from pymongo import MongoClient
from pymongo.errors import PyMongoError

from mtask import TaskClient

POOL = "poolhandlers:registry"
"""tests/poolhandlers.py: handlers in child processes."""
OPTIONS = {
    "worker_timeout_ms": 2000,
    "ping_interval_ms": 200,
    "max_retries": 5,
    "retry_delay_ms": 0,
}


def _task(client: TaskClient, key: str) -> dict[str, Any]:
    doc = client.collection.find_one({"_id": key})
    assert doc is not None
    return doc


async def _rescued(
    uri: str, db: str, client: TaskClient, key: str, timeout: float, **spawn: Any
) -> dict[str, Any]:
    """A worker process ``rescuer`` (``spawn``: ``worker_process``'s options) runs ``key`` to
    its success after the victim's run timed out; the task's document."""
    with worker_process(uri, db, "--worker-id", "rescuer", **spawn):
        await wait_for(lambda: _task(client, key)["status"] == "succeeded", timeout=timeout)
    doc = _task(client, key)
    assert [(r["worker_id"], r["state"]) for r in doc["runs"]] == [
        ("victim", "TIMEOUT"),
        ("rescuer", "SUCCESS"),
    ]
    return doc


def _rows(client: TaskClient, key: str, collection: str = "step_rows") -> Counter[int]:
    return Counter(d["step"] for d in client.db[collection].find({"task": key}))


async def test_a_killed_workers_recorded_steps_are_replayed_by_the_takeover(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    """The victim records steps 1-3 and is killed (SIGKILL) before step 4; the rescuer takes
    the task over after the lease: it runs steps 4 and 5 only and gets 1-3 from the record."""
    params = {"uri": mongo_uri, "db": db_name, "hold_after": {"victim": 3}}
    client.publish("step_chain", "k", params, options=OPTIONS)
    with worker_process(mongo_uri, db_name, "--worker-id", "victim", crash_expected=True) as victim:
        await wait_for(lambda: len(_task(client, "k").get("steps", [])) == 3, timeout=30)
        victim.send_signal(signal.SIGKILL)
        await asyncio.to_thread(victim.wait, 10)
    before = _rows(client, "k")
    assert before == {1: 1, 2: 1, 3: 1}
    doc = await _rescued(mongo_uri, db_name, client, "k", 30)
    first, second = (r["run_id"] for r in doc["runs"])
    assert _rows(client, "k") == {1: 1, 2: 1, 3: 1, 4: 1, 5: 1}
    by_step = {d["step"]: d["run_id"] for d in client.db["step_rows"].find({"task": "k"})}
    assert by_step == {1: first, 2: first, 3: first, 4: second, 5: second}
    steps = doc["steps"]
    assert [(s["name"], s["state"], s["attempts"]) for s in steps] == [
        (f"s{i}", "done", 1) for i in range(1, 6)
    ]
    assert [s["run_id"] for s in steps] == [first, first, first, second, second]
    # the rescuer's result holds the victim's recorded results for steps 1-3
    assert doc["result"] == [{"step": i, "run_id": s["run_id"]} for i, s in enumerate(steps, 1)]


async def test_a_worker_killed_mid_chain_of_continues_is_taken_over_and_the_chain_ends(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    """A task that continues as new 20 times: the victim runs it to its 10th journal, records
    that journal's step and is killed (SIGKILL); the rescuer takes the task over after the
    lease, replays that journal's step (not run again) and continues to the end: each
    journal's step ran once, the key kept, ``continued.n`` 20."""
    params = {"uri": mongo_uri, "db": db_name, "gen": 0, "until": 20, "hold_at": {"victim": 10}}
    client.publish("continue_chain", "cc", params, options=OPTIONS)

    def held() -> bool:
        doc = _task(client, "cc")
        return doc["params"]["gen"] == 10 and len(doc.get("steps", [])) == 1

    with worker_process(mongo_uri, db_name, "--worker-id", "victim", crash_expected=True) as victim:
        await wait_for(held, timeout=60)
        victim.send_signal(signal.SIGKILL)
        await asyncio.to_thread(victim.wait, 10)
    with worker_process(mongo_uri, db_name, "--worker-id", "rescuer"):
        await wait_for(lambda: _task(client, "cc")["status"] == "succeeded", timeout=60)
    doc = _task(client, "cc")
    assert doc["result"] == 20 and doc["continued"]["n"] == 20
    rows = Counter(d["gen"] for d in client.db["step_rows"].find({"task": "cc"}))
    assert rows == {gen: 1 for gen in range(21)}  # the 10th journal's step not run again
    runs = [(r["worker_id"], r["state"]) for r in doc["runs"]]
    assert ("victim", "TIMEOUT") in runs and runs[-1] == ("rescuer", "SUCCESS")
    assert [j["n"] for j in doc["continued"]["journals"]] == list(range(11, 21))


async def test_a_killed_workers_process_isolated_steps_are_replayed_by_the_takeover(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    """The same takeover with the handler in a child process (``isolation="process"``): the
    child records steps 1-3 through its worker, which is killed (SIGKILL) while the child holds;
    the child dies with it, and the rescuer's child runs steps 4 and 5 only."""
    params = {"uri": mongo_uri, "db": db_name, "hold_after": {"victim": 3}}
    client.publish("step_chain_in_child", "p", params, options=OPTIONS)
    with worker_process(
        mongo_uri, db_name, "--worker-id", "victim", app=POOL, crash_expected=True
    ) as victim:
        await wait_for(lambda: len(_task(client, "p").get("steps", [])) == 3, timeout=60)
        victim.send_signal(signal.SIGKILL)
        await asyncio.to_thread(victim.wait, 10)
    child = client.db["step_rows"].find_one({"task": "p", "step": 3})["pid"]
    assert child != victim.pid
    await wait_for(lambda: dead(child), timeout=10)  # it can record nothing more
    assert _rows(client, "p") == {1: 1, 2: 1, 3: 1}
    doc = await _rescued(mongo_uri, db_name, client, "p", 60, app=POOL)
    first, second = (r["run_id"] for r in doc["runs"])
    rows = list(client.db["step_rows"].find({"task": "p"}))
    assert sorted((d["step"], d["run_id"]) for d in rows) == [
        (1, first), (2, first), (3, first), (4, second), (5, second)
    ]  # fmt: skip
    assert len({d["pid"] for d in rows if d["run_id"] == second} - {child}) == 1
    assert [(s["name"], s["state"], s["attempts"], s["run_id"]) for s in doc["steps"]] == [
        (f"s{i}", "done", 1, first if i <= 3 else second) for i in range(1, 6)
    ]
    steps = doc["steps"]
    assert doc["result"] == [{"step": i, "run_id": s["run_id"]} for i, s in enumerate(steps, 1)]


async def test_a_frozen_worker_cannot_record_the_step_it_was_in(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    """The zombie is frozen (SIGSTOP) inside step 2's function, past its lease; the rescuer
    takes over and finishes the task. Resumed, the zombie's step function returns (it ignores
    the cancellation) and its record write meets the fence: ``LeaseLost``, nothing written."""
    params = {"uri": mongo_uri, "db": db_name, "count": 4, "block_in": {"zombie": 2}}
    client.publish("step_chain", "z", params, options=OPTIONS)
    notes = client.db["step_notes"]
    with worker_process(mongo_uri, db_name, "--worker-id", "zombie") as zombie:
        await wait_for(lambda: notes.find_one({"task": "z", "event": "blocked"}), timeout=30)
        zombie.send_signal(signal.SIGSTOP)
        try:
            with worker_process(mongo_uri, db_name, "--worker-id", "rescuer"):
                await wait_for(lambda: _task(client, "z")["status"] == "succeeded", timeout=30)
            finished = _task(client, "z")
        finally:
            zombie.send_signal(signal.SIGCONT)
        first = finished["runs"][0]["run_id"]
        attempt = {"task": "z", "event": "record", "run_id": first}
        noted = await wait_for(lambda: notes.find_one(attempt), timeout=30)
    assert zombie.returncode == 0  # stopped by the SIGTERM at the end, not crashed
    assert noted["error"] == "LeaseLost"
    assert notes.count_documents({"event": "record"}) == 1  # the rescuer never blocked
    doc = _task(client, "z")
    assert doc["steps"] == finished["steps"]  # the zombie wrote nothing after the takeover
    assert doc["runs"] == finished["runs"]
    assert [(r["worker_id"], r["state"]) for r in doc["runs"]] == [
        ("zombie", "TIMEOUT"),
        ("rescuer", "SUCCESS"),
    ]
    second = doc["runs"][1]["run_id"]
    assert [(s["name"], s["state"], s["attempts"], s["run_id"]) for s in doc["steps"]] == [
        ("s1", "done", 1, first),
        ("s2", "done", 1, second),
        ("s3", "done", 1, second),
        ("s4", "done", 1, second),
    ]
    assert [t["run_id"] for t in doc["steps"][1]["tries"]] == [second]
    assert doc["result"] == [
        {"step": 1, "run_id": first},
        *({"step": i, "run_id": second} for i in (2, 3, 4)),
    ]
    rows = sorted((d["step"], d["run_id"]) for d in client.db["step_rows"].find({"task": "z"}))
    # step 2's function ran in both runs (effects are at least once); its record is the second's
    assert rows == sorted([(1, first), (2, first), (2, second), (3, second), (4, second)])


class Coherence:
    """Reads the task's step records and its business rows at one point in time (a snapshot
    session), over and over, from a thread: a row without its step's record, or a record
    without its row, or a row twice, is noted."""

    def __init__(self, uri: str, db: str, key: str) -> None:
        self.mongo: MongoClient[dict[str, Any]] = MongoClient(
            uri, serverSelectionTimeoutMS=2000, socketTimeoutMS=2000
        )
        self.db, self.key = self.mongo[db], key
        self.samples: list[tuple[list[int], list[int]]] = []
        self.stop = threading.Event()

    def sample(self) -> None:
        with self.mongo.start_session(snapshot=True) as session:
            task = self.db["tasks"].find_one({"_id": self.key}, session=session)
            rows = self.db["txn_rows"].find({"task": self.key}, session=session).to_list()
        recorded = [
            int(s["name"][1:]) for s in (task or {}).get("steps", []) if s["state"] == "done"
        ]
        self.samples.append((sorted(recorded), sorted(r["step"] for r in rows)))

    def run(self) -> None:
        while not self.stop.is_set():
            with contextlib.suppress(PyMongoError):  # failing over: sample again
                self.sample()
            self.stop.wait(0.02)

    def incoherent(self) -> list[tuple[list[int], list[int]]]:
        return [(recorded, rows) for recorded, rows in self.samples if recorded != rows]


@pytest.mark.slow
@pytest.mark.timeout(180)
async def test_transactional_steps_survive_a_primary_killed_mid_step(
    tmp_path: Path, db_name: str
) -> None:
    """Step t2's transaction has inserted its row on the primary (not committed) and waits for
    the test; the primary is killed (SIGKILL), the two others elect a new one, and then the
    test lets t2 go on: its transaction died with the old primary, so it is run again, on the
    new primary, and commits there with its record. Every step: its row and its record both,
    exactly once; at no point in between one without the other."""
    replica_set = ReplicaSet(tmp_path / "rs")
    uri = await asyncio.to_thread(replica_set.start)
    coherence = Coherence(uri, db_name, "x")
    sampler = threading.Thread(target=coherence.run, daemon=True)
    try:
        with TaskClient(uri, database=db_name) as client:
            client.ensure_indexes()
            for name in ("txn_rows", "step_notes", "step_control"):  # not made in a transaction
                client.db.create_collection(name)
            options = {**OPTIONS, "worker_timeout_ms": 30_000, "ping_interval_ms": 500}
            params = {"uri": uri, "db": db_name, "count": 4, "block_in": 2, "slow_ms": 300}
            client.publish("txn_step_chain", "x", params, options=options)
            notes = client.db["step_notes"]
            written = {"task": "x", "step": 2, "event": "written"}
            sampler.start()
            with worker_process(uri, db_name, "--worker-id", "w"):
                await wait_for(lambda: notes.count_documents(written) >= 1, timeout=60)
                old = replica_set.wait_primary()
                os.kill(replica_set.pids.pop(old), signal.SIGKILL)
                await asyncio.to_thread(replica_set.wait_primary, 60, old)
                await _retried(lambda: client.db["step_control"].insert_one({"_id": "x"}))
                await wait_for(lambda: _status(client, "x") == "succeeded", timeout=60)
            doc = _task(client, "x")
            rows = list(client.db["txn_rows"].find({"task": "x"}))
            body_runs = Counter(d["step"] for d in notes.find({"task": "x"}))
    finally:
        coherence.stop.set()
        if sampler.is_alive():
            sampler.join(10)
        coherence.mongo.close()
        replica_set.stop()
    assert Counter(r["step"] for r in rows) == {1: 1, 2: 1, 3: 1, 4: 1}
    steps = doc["steps"]
    assert [(s["name"], s["state"], s.get("transactional")) for s in steps] == [
        (f"t{i}", "done", True) for i in range(1, 5)
    ]
    recorded_by = {i: s["run_id"] for i, s in enumerate(steps, 1)}
    assert {r["step"]: r["run_id"] for r in rows} == recorded_by
    assert doc["result"] == [{"step": i} for i in range(1, 5)]
    assert [r["state"] for r in doc["runs"]].count("SUCCESS") == 1
    assert doc["runs"][-1]["state"] == "SUCCESS"
    # t2's body ran again after the kill: its first row was never committed
    assert body_runs[2] >= 2 and body_runs[1] >= 1 and body_runs[3] >= 1 and body_runs[4] >= 1
    assert coherence.samples, "no consistent read of the task and its rows"
    assert coherence.incoherent() == []
    assert coherence.samples[-1] == ([1, 2, 3, 4], [1, 2, 3, 4])


def _status(client: TaskClient, key: str) -> str | None:
    try:
        doc = client.collection.find_one({"_id": key}, {"status": 1})
    except PyMongoError:
        return None  # failing over: ask again
    return None if doc is None else str(doc["status"])


async def _retried(write: Any, timeout: float = 60) -> None:
    async def attempt() -> bool:
        try:
            await asyncio.to_thread(write)
        except PyMongoError:
            return False
        return True

    await wait_for(attempt, timeout=timeout, every=0.2)
