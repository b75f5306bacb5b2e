"""Every worker a host of its own (a network namespace), each reaching mongod through a proxy
of its own (``socat`` on mongod's Unix socket): the holder of the relay cut off, frozen and
killed while tasks flow, with the sweep switched off, so that what finds the work is the relay
and its standby alone. Its standby takes the lease over, long before it runs
out; the tasks published meanwhile are claimed by live workers while the fault lasts; nothing is
lost or run twice, nothing stays stranded. How long each takes is measured by the bench (WR),
not asserted here."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import Cluster, Proxies, required, until_finished, wait_for
from invariants import check
from pymongo import MongoClient

from mtask import TaskClient
from mtask.driver import SyncDriver, collections
from mtask.store import relays

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(900)]

LEASE = {"worker_timeout_ms": 1500, "ping_interval_ms": 300, "max_retries": 20}
HOSTS = 3


class Publisher(threading.Thread):
    """Publishes a task every ``every`` seconds until stopped; remembers each key."""

    def __init__(self, uri: str, db: str, every: float = 0.05) -> None:
        super().__init__(daemon=True)
        self.client = TaskClient(uri, database=db)
        self.every = every
        self.keys: list[str] = []
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.is_set():
            key = f"t{len(self.keys):05d}"
            self.client.publish("work", key, {"ms": 20}, options=LEASE)
            self.keys.append(key)
            time.sleep(self.every)

    def stop(self) -> list[str]:
        self.stopping.set()
        self.join(timeout=30)
        self.client.close()
        return self.keys


def relay_host(mongo: MongoClient[dict[str, Any]], db: str) -> str | None:
    relay = SyncDriver(collections(mongo[db])).run(relays.holder("tasks"))
    return None if relay is None else relay.split("/")[0]


def standby_host(mongo: MongoClient[dict[str, Any]], db: str) -> str | None:
    """The worker that holds the post of the relay's standby (``store.relays.stand_by``)."""
    lease = mongo[db]["relays"].find_one({"_id": "tasks"}) or {}
    standby = lease.get("standby")
    return standby if isinstance(standby, str) else None


async def relay_and_standby(
    mongo: MongoClient[dict[str, Any]], db: str
) -> tuple[str | None, str | None]:
    """The relay's host, and its standby's once one holds the post (``None`` after 30 s)."""
    with contextlib.suppress(TimeoutError):
        await wait_for(lambda: relay_host(mongo, db) and standby_host(mongo, db), timeout=30)
    return relay_host(mongo, db), standby_host(mongo, db)


async def taken_over(
    mongo: MongoClient[dict[str, Any]],
    db: str,
    client: TaskClient,
    holder: str,
    end: dt.datetime,
) -> tuple[str, dt.datetime, dt.datetime]:
    """Once another host holds the relay's lease: that host, when it was first seen holding it,
    and when ``holder``'s lease was to run out (``end``, read before its fault, or its last
    renewal seen after), both on the server's clock."""
    holders_end = [end]
    seen: list[tuple[str, dt.datetime]] = []

    def other_host() -> bool:
        lease = mongo[db]["relays"].find_one({"_id": "tasks"}) or {}
        relay, until = lease.get("relay"), lease.get("expires_at")
        host = relay.split("/")[0] if isinstance(relay, str) else None
        if host == holder and isinstance(until, dt.datetime):
            holders_end.append(until)
        elif host is not None and host != holder:
            seen.append((host, client.now()))
        return bool(seen)

    await wait_for(other_host, timeout=60)
    (successor, at), end = seen[0], max(holders_end)
    return successor, at, end


def published_after(client: TaskClient, keys: list[str], cut: dt.datetime) -> list[str]:
    """Those of ``keys`` created after ``cut`` (the server's clock), in their order."""
    after = {
        d["_id"]
        for d in client.collection.find(
            {"_id": {"$in": keys}, "created_at": {"$gt": cut}}, {"_id": 1}
        )
    }
    return [k for k in keys if k in after]


def first_claimers(client: TaskClient, keys: list[str]) -> dict[str, str]:
    """Who claimed each of ``keys`` first (those claimed so far)."""
    docs = client.collection.find({"_id": {"$in": keys}}, {"runs.worker_id": 1})
    return {d["_id"]: d["runs"][0]["worker_id"] for d in docs if d.get("runs")}


@pytest.fixture
def hosts(mongo_uri: str, db_name: str, tmp_path: Path) -> Iterator[tuple[Cluster, Proxies]]:
    required(["unshare", "--net", "true"], ["socat", "-V"], hint="util-linux, socat, root")
    port = int(mongo_uri.split(":")[2].split("/")[0])
    mongod_socket = f"/tmp/mongodb-{port}.sock"
    direct = f"mongodb://{mongod_socket.replace('/', '%2F')}/?directConnection=true"
    cluster = Cluster(direct, db_name, tmp_path)  # handlers log straight to mongod
    proxies = Proxies(mongod_socket, tmp_path)
    try:
        for i in range(HOSTS):
            uri = proxies.start(f"h{i}")
            cluster.spawn(
                f"h{i}", "--uri", uri, "--concurrency", "4",
                "--sweep-interval", "3600",  # off: the relay and its standby alone find work
                prefix=["unshare", "--net"],
            )  # fmt: skip
        yield cluster, proxies
    finally:
        cluster.close()
        proxies.close()


async def test_the_relays_holder_cut_off_frozen_and_killed(
    hosts: tuple[Cluster, Proxies],
    mongo: MongoClient[dict[str, Any]],
    mongo_uri: str,
    db_name: str,
    client: TaskClient,
) -> None:
    cluster, proxies = hosts
    await wait_for(lambda: len(client.workers()) == HOSTS, timeout=60)
    await wait_for(lambda: relay_host(mongo, db_name), timeout=30)
    publisher = Publisher(mongo_uri, db_name)
    publisher.start()
    try:
        for fault in ("cut off", "frozen", "killed"):
            holder, standby = await relay_and_standby(mongo, db_name)
            assert holder is not None and standby not in (None, holder), (fault, standby)
            holders_end = (mongo[db_name]["relays"].find_one({"_id": "tasks"}) or {})["expires_at"]
            if fault == "cut off":
                proxies.signal(holder, signal.SIGSTOP)
            else:
                cluster.signal(holder, signal.SIGKILL if fault == "killed" else signal.SIGSTOP)
            # published from now on, on the server's clock, the holder cannot claim them (a task
            # published as the signal went may have been claimed by it a moment before: a
            # rehearsal saw one; its key reached the list only after the signal)
            began, cut = len(publisher.keys), client.now()
            successor, seen, holders_end = await taken_over(
                mongo, db_name, client, holder, holders_end
            )
            assert successor == standby, (fault, holder, standby, successor)  # it took over,
            # long before the holder's lease ran out (a successor that only took a lease that had
            # run out is seen after its end), both on the server's clock
            assert seen < holders_end, (fault, "taken over only once the lease ran out", seen)
            await asyncio.sleep(1.0)  # more tasks published with the holder still away
            during = published_after(client, publisher.keys[began:], cut)
            # claimed by the live hosts while the holder is still away, without the sweep
            await wait_for(
                lambda keys=during: len(first_claimers(client, keys)) == len(keys), timeout=60
            )
            assert holder not in first_claimers(client, during).values(), fault
            if fault == "cut off":
                proxies.signal(holder, signal.SIGCONT)
            elif fault == "frozen":
                cluster.signal(holder, signal.SIGCONT)
            await until_some_finished(client, during)
    finally:
        keys = publisher.stop()
    await until_finished(client, len(keys), timeout=120, explain=cluster.explainer(client))
    report = check(mongo[db_name], set(keys))
    assert not report.problems, "\n".join(report.problems)
    assert report.by_status["succeeded"] == len(keys)
    # finding work goes on, the sweep still off: a task published now is run
    client.publish("work", "after", {"ms": 1}, options=LEASE)
    await until_some_finished(client, ["after"])
    for worker_id, proc in cluster.procs.items():
        assert proc.poll() is None, (worker_id, cluster.log_of(worker_id)[-2000:])
    print(f"tasks={len(keys)} runs={report.runs}")


async def until_some_finished(client: TaskClient, keys: list[str], timeout: float = 90) -> None:
    await wait_for(
        lambda: (
            client.collection.count_documents({"_id": {"$in": keys}, "status": "succeeded"})
            == len(keys)
        ),
        timeout=timeout,
    )
