"""Worker processes on one host share one change stream (``--stream shared``):
one server-side stream for all of them, every task run once, the relay killed with SIGKILL
and taken over by another process."""

from __future__ import annotations

import signal
import subprocess
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from harness import change_streams, spawn_worker, stop_process, wait_for
from needs import missing
from pymongo import MongoClient

from mtask import TaskClient, driver
from mtask.store import relays

Mongo = MongoClient[dict[str, Any]]


def spawn(uri: str, db: str, *extra: str, host: bool = False) -> subprocess.Popen[str]:
    """A worker process; with ``host``, a host of its own: its own network namespace, reaching
    mongod through its Unix socket (``uri`` must say so)."""
    return spawn_worker(
        uri, db, "--log-level", "WARNING", "--concurrency", "4", *extra,
        prefix=["unshare", "--net"] if host else None, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def stop(procs: list[subprocess.Popen[str]]) -> None:
    for proc in procs:
        proc.terminate()
    for proc in procs:
        stop_process(proc)


Workers = Callable[..., list[subprocess.Popen[str]]]


@pytest.fixture
def spawned(db_name: str) -> Iterator[Workers]:
    """``spawned(uri, count, *extra, name="w", host=False)`` spawns ``count`` worker processes
    (ids ``w0``, ``w1``…; ``name=None``: ids of their own); each is stopped after the test,
    a frozen one too."""
    procs: list[subprocess.Popen[str]] = []

    def start(
        uri: str, count: int, *extra: str, name: str | None = "w", host: bool = False
    ) -> list[subprocess.Popen[str]]:
        ids = [("--worker-id", f"{name}{i}") if name else () for i in range(count)]
        started = [spawn(uri, db_name, *worker_id, *extra, host=host) for worker_id in ids]
        procs.extend(started)
        return started

    yield start
    stop(procs)


def relay_worker(mongo: Mongo, db: str) -> str | None:
    """The worker id of the process holding the relay for ``db`` (its unexpired lease)."""
    relay = driver.SyncDriver(driver.collections(mongo[db])).run(relays.holder("tasks"))
    return None if relay is None else relay.split("/")[0]


def live_streams(mongo: Mongo, db: str) -> set[int]:
    """The change streams on ``db`` someone still reads (a getMore in the last two seconds;
    a live one waits 0.5 s at most), not those a killed process left behind."""
    now = mongo.admin.command("hello")["localTime"].replace(tzinfo=None)
    return {
        op["cursor"]["cursorId"]
        for op in change_streams(mongo, db)
        if "cursor" in op
        and (
            op.get("type") == "op"
            or (now - op["cursor"]["lastAccessDate"].replace(tzinfo=None)).total_seconds() < 2
        )
    }


def relay_subscribers(client: TaskClient, holder: str) -> int | None:
    """How many subscribers the relay's heartbeat says it has."""
    for doc in client.collection.database["workers"].find({"_id": holder}):
        return ((doc.get("stream") or {}).get("relay") or {}).get("subscribers")
    return None


def all_dispatched(client: TaskClient, count: int) -> bool:
    """Whether ``count`` workers' heartbeats say the relay hands them their tasks: none of them
    follows an own stream (as a subscriber does until its relay's first frame)."""
    modes = [(w.get("stream") or {}).get("mode") for w in client.workers()]
    return modes.count("dispatched") == count


def publish(client: TaskClient, prefix: str, count: int, **options: Any) -> list[str]:
    keys = [f"{prefix}{i:03}" for i in range(count)]
    client.publish_many(
        [{"name": "echo", "key": k, "params": {"k": k}, "options": options} for k in keys]
    )
    return keys


def finished(client: TaskClient, keys: list[str]) -> bool:
    return client.collection.count_documents({"_id": {"$in": keys}, "status": "succeeded"}) == len(
        keys
    )


def runs_per_task(client: TaskClient, keys: list[str]) -> Counter[str]:
    docs = client.collection.find({"_id": {"$in": keys}}, {"runs.run_id": 1})
    return Counter({doc["_id"]: len(doc.get("runs", [])) for doc in docs})


async def test_worker_processes_share_one_stream_and_take_over_a_killed_relay(
    mongo_uri: str, mongo: Mongo, db_name: str, client: TaskClient, spawned: Workers
) -> None:
    lease = {"worker_timeout_ms": 2000, "ping_interval_ms": 300}
    procs = spawned(mongo_uri, 4, "--stream", "shared")
    await wait_for(lambda: len(client.workers()) == 4, timeout=60)
    first = await wait_for(lambda: relay_worker(mongo, db_name), timeout=30)
    assert first in {f"w{i}" for i in range(4)}
    await wait_for(lambda: relay_subscribers(client, first) == 4, timeout=30)
    await wait_for(lambda: all_dispatched(client, 4), timeout=30)
    await wait_for(lambda: len(change_streams(mongo, db_name)) == 1)
    assert len(live_streams(mongo, db_name)) == 1

    # every task once, run by several processes, found by the shared stream's events
    before = publish(client, "a", 60, **lease)
    await wait_for(lambda: finished(client, before), timeout=60)
    assert set(runs_per_task(client, before).values()) == {1}
    workers = {d["result"]["worker"] for d in client.collection.find({"_id": {"$in": before}})}
    assert len(workers) >= 2
    assert len(change_streams(mongo, db_name)) == 1  # not one per process

    # kill -9 the relay while tasks come: another process takes the stream over
    during = publish(client, "b", 30, **lease)
    victim = procs[int(first[1:])]
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=10)
    more = publish(client, "c", 30, **lease)
    second = await wait_for(lambda: (w := relay_worker(mongo, db_name)) != first and w, timeout=30)
    assert procs[int(second[1:])].poll() is None
    after = publish(client, "d", 60, **lease)
    await wait_for(lambda: finished(client, during + more + after), timeout=90)
    assert set(runs_per_task(client, after).values()) == {1}  # once, after the takeover
    # tasks the victim held were taken over when its lease expired: none stranded
    assert client.collection.count_documents({"status": {"$ne": "succeeded"}}) == 0
    # the victim's cursor stays on the server, idle, until its timeout (as with own streams)
    await wait_for(lambda: len(live_streams(mongo, db_name)) == 1, timeout=30)
    assert all(p.poll() is None for p in procs if p is not victim)


async def test_a_killed_subscriber_is_let_go_and_its_keys_handed_on(
    mongo_uri: str, mongo: Mongo, db_name: str, client: TaskClient, spawned: Workers
) -> None:
    """kill -9 a worker the relay hands tasks to (not the relay): the keys handed to it come
    back, what it had claimed is taken over when its leases end, and the relay lets it go
    (``SILENT_SUBSCRIBER``): nothing is stranded, every task runs to a success."""
    lease = {"worker_timeout_ms": 2000, "ping_interval_ms": 300}
    procs = spawned(mongo_uri, 3, "--stream", "shared")
    holder = await wait_for(lambda: relay_worker(mongo, db_name), timeout=60)
    await wait_for(lambda: relay_subscribers(client, holder) == 3, timeout=30)
    warm = publish(client, "a", 30, **lease)
    await wait_for(lambda: finished(client, warm), timeout=60)
    victim = next(p for i, p in enumerate(procs) if f"w{i}" != holder)
    during = publish(client, "b", 30, **lease)
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=10)
    after = publish(client, "c", 60, **lease)  # some are handed to the dead one first
    await wait_for(lambda: finished(client, warm + during + after), timeout=90)
    await wait_for(lambda: relay_subscribers(client, holder) == 2, timeout=30)
    assert client.collection.count_documents({"status": {"$ne": "succeeded"}}) == 0
    assert all(p.poll() is None for p in procs if p is not victim)


async def test_own_streams_when_asked(
    mongo_uri: str, mongo: Mongo, db_name: str, client: TaskClient, spawned: Workers
) -> None:
    spawned(mongo_uri, 2, "--stream", "own", name=None)
    await wait_for(lambda: len(client.workers()) == 2, timeout=60)
    await wait_for(lambda: len(change_streams(mongo, db_name)) == 2)
    assert relay_worker(mongo, db_name) is None
    keys = publish(client, "o", 20)
    await wait_for(lambda: finished(client, keys), timeout=60)
    assert set(runs_per_task(client, keys).values()) == {1}


async def test_a_frozen_relay_is_left_for_own_streams(
    mongo_uri: str, mongo: Mongo, db_name: str, client: TaskClient, spawned: Workers
) -> None:
    """SIGSTOP the relay's process: its connections stay open but say nothing. The other
    processes see its lease go stale, leave it and find their work alone until one of them
    holds the lease; once it thaws, nothing ran twice."""
    lease = {"worker_timeout_ms": 2000, "ping_interval_ms": 300}
    procs = spawned(mongo_uri, 3, "--stream", "shared")
    await wait_for(lambda: len(client.workers()) == 3, timeout=60)
    first = await wait_for(lambda: relay_worker(mongo, db_name), timeout=30)
    frozen = procs[int(first[1:])]
    warm = publish(client, "w", 20, **lease)
    await wait_for(lambda: finished(client, warm), timeout=60)
    frozen.send_signal(signal.SIGSTOP)
    keys = publish(client, "f", 40, **lease)
    await wait_for(lambda: finished(client, keys), timeout=90)
    runs = runs_per_task(client, keys)
    workers = {d["result"]["worker"] for d in client.collection.find({"_id": {"$in": keys}})}
    assert f"w{procs.index(frozen)}" not in workers

    def left() -> bool:  # each of the others left the frozen relay (its lease went stale)
        beats = {w["_id"]: w.get("stream") or {} for w in client.workers()}
        others = [f"w{i}" for i, p in enumerate(procs) if p is not frozen]
        return all(beats.get(w, {}).get("left_silent", 0) >= 1 for w in others)

    await wait_for(left, timeout=30)
    frozen.send_signal(signal.SIGCONT)
    after = publish(client, "a", 20, **lease)
    await wait_for(lambda: finished(client, after), timeout=60)
    assert set(runs.values()) == {1} and set(runs_per_task(client, after).values()) == {1}
    assert client.collection.count_documents({"status": {"$ne": "succeeded"}}) == 0


def own_hosts_available() -> None:
    """``unshare --net`` (root, util-linux) gives a process a network of its own: required
    under CI, else the test is skipped with the reason."""
    probe = subprocess.run(["unshare", "--net", "true"], capture_output=True, check=False)
    if probe.returncode != 0:
        why = f"cannot make a network namespace: {probe.stderr.decode().strip()}"
        missing(why)


async def test_workers_on_different_hosts_share_one_stream_and_one_relay(
    mongo_uri: str, mongo: Mongo, db_name: str, client: TaskClient, spawned: Workers
) -> None:
    """Each worker in a network namespace of its own (as one worker per pod or VM): they share
    one change stream and one relay through MongoDB alone, every task runs once, and a killed
    relay is taken over by a worker on another host."""
    own_hosts_available()
    port = int(mongo_uri.split(":")[2].split("/")[0])
    uri = f"mongodb://%2Ftmp%2Fmongodb-{port}.sock/?directConnection=true"
    lease = {"worker_timeout_ms": 2000, "ping_interval_ms": 300}
    procs = spawned(uri, 4, "--stream", "shared", name="h", host=True)
    await wait_for(lambda: len(client.workers()) == 4, timeout=60)
    first = await wait_for(lambda: relay_worker(mongo, db_name), timeout=30)
    await wait_for(lambda: relay_subscribers(client, first) == 4, timeout=30)
    await wait_for(lambda: all_dispatched(client, 4), timeout=30)
    await wait_for(lambda: len(change_streams(mongo, db_name)) == 1)
    keys = publish(client, "x", 80, **lease)
    await wait_for(lambda: finished(client, keys), timeout=60)
    assert set(runs_per_task(client, keys).values()) == {1}
    workers = {d["result"]["worker"] for d in client.collection.find({"_id": {"$in": keys}})}
    assert len(workers) >= 3  # handed out across the hosts
    assert len(change_streams(mongo, db_name)) == 1  # one for the cluster, not per host

    victim = procs[int(first[1:])]
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=10)
    more = publish(client, "y", 60, **lease)
    await wait_for(lambda: relay_worker(mongo, db_name) not in (None, first), timeout=60)
    await wait_for(lambda: finished(client, more), timeout=90)
    assert set(runs_per_task(client, more).values()) == {1}
    assert client.collection.count_documents({"status": {"$ne": "succeeded"}}) == 0
    assert all(p.poll() is None for p in procs if p is not victim)
