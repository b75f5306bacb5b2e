"""WR: finding work when the relay's holder, or one subscriber, fails, at 16 hosts.

Every worker is a host of its own (a network namespace, ``unshare --net``), reaching mongod's
Unix socket through a ``socat`` proxy of its own, so that a host can be cut off by freezing its
proxy (its connections stay open and say nothing, as with a network partition). The sweep is
switched off (``--sweep-interval 3600``): what finds the work is the relay and its standby, not
the sweep. One fault a cluster, four clusters:

- ``killed``: the relay's holder ``kill -9``;
- ``frozen``: the holder stopped (``SIGSTOP``), thawed after the window;
- ``cut off``: the holder's proxy stopped, resumed after the window;
- ``subscriber cut off``: a host the relay hands keys to (neither the holder nor the standby)
  cut off: its handed keys must go to another host.

Before each fault, four ``linger`` tasks occupy the holder's own slots (the relay hands its own
worker first: without them it would run every task, and a subscriber would be handed none),
then ``stamp`` tasks are published at ``RATE`` a second, before, during and after the fault.
Figures, all read on this machine's clock (``time.time()``, which every namespace shares):

- the first-claim wait of the tasks published during the fault (``WINDOW`` seconds from it):
  handler start - publish, max and p50; target ≤ 1 s;
- the takeover of the holder's own tasks: the start of their next run - the fault; target ≤
  their lease (``worker_timeout_ms``, 2 s) + 1 s;
- every task succeeded once (no duplicate success).

``MTASK_WR_HOSTS`` and ``MTASK_WR_FAULTS`` (comma-separated) for by-hand runs.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import shutil
import signal
import statistics
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pymongo import MongoClient

from bench.support import LOOP, ROOT, Result, pct
from mtask.client import TaskClient
from mtask.testing import worker_argv

if TYPE_CHECKING:
    from bench.workloads import Bench

Doc = dict[str, Any]
FAULTS = ("killed", "frozen", "cut off", "subscriber cut off")
RATE = 20.0
"""Tasks a second published while the fault lasts (and before and after it)."""
WINDOW = 4.0
"""Seconds from the fault during which the tasks published count as published during it."""
LEASE_MS = 2000
"""The lease (``worker_timeout_ms``) of every task: the holder's own tasks are taken over when
it ends."""
LINGER_MS = 8000
"""How long a ``linger`` task runs: longer than the window, so that the holder's own slots are
full while the fault lasts."""


class Hosts:
    """Worker processes, each a host of its own with a ``socat`` proxy of its own."""

    def __init__(self, mongod_socket: str, database: str, root: Path) -> None:
        self.mongod_socket = mongod_socket
        self.database = database
        self.root = root
        self.workers: dict[str, subprocess.Popen[bytes]] = {}
        self.proxies: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, host: str) -> None:
        path = self.root / f"{host}.sock"
        self.proxies[host] = subprocess.Popen(
            ["socat", f"UNIX-LISTEN:{path},fork,unlink-early",
             f"UNIX-CONNECT:{self.mongod_socket}"],
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # a freeze reaches the connections it forked too
        )  # fmt: skip
        deadline = time.monotonic() + 10
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        uri = f"mongodb://{str(path).replace('/', '%2F')}/?directConnection=true"
        argv = worker_argv(
            "bench.app:registry", uri, self.database, "--loop", LOOP, "--worker-id", host,
            "--concurrency", "4", "--sweep-interval", "3600",
        )  # fmt: skip
        self.workers[host] = subprocess.Popen(
            ["unshare", "--net", *argv],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            cwd=ROOT,
            start_new_session=True,
        )

    def signal(self, host: str, sig: signal.Signals, proxy: bool = False) -> None:
        proc = (self.proxies if proxy else self.workers)[host]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)

    def close(self) -> None:
        """Stop the workers, then their proxies (a worker stops through its proxy)."""
        for procs in (self.workers, self.proxies):
            for proc in procs.values():
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGCONT)
                    os.killpg(proc.pid, signal.SIGTERM)
            for proc in procs.values():
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=10)


class Publisher(threading.Thread):
    """Publishes a ``stamp`` task every 1/``RATE`` s until stopped, each with its publish time."""

    def __init__(self, uri: str, database: str) -> None:
        super().__init__(daemon=True)
        self.client = TaskClient(uri, database=database)
        self.published: list[tuple[str, float]] = []
        self.stopping = threading.Event()

    def run(self) -> None:
        options = {"worker_timeout_ms": LEASE_MS, "ping_interval_ms": 300}
        began = time.monotonic()
        while not self.stopping.is_set():
            key, now = f"s{len(self.published):05d}", time.time()
            self.client.publish("stamp", key, {"t": now}, options=options)
            self.published.append((key, now))
            pause = began + len(self.published) / RATE - time.monotonic()
            if pause > 0:
                self.stopping.wait(pause)

    def stop(self) -> list[tuple[str, float]]:
        self.stopping.set()
        self.join(timeout=30)
        self.client.close()
        return self.published


def _seconds(when: dt.datetime) -> float:
    """A stored time (the server's clock, as the claimer estimated it) as ``time.time()``."""
    return (when if when.tzinfo else when.replace(tzinfo=dt.UTC)).timestamp()


def _wait(check: Any, timeout: float = 120.0, what: str = "a condition") -> Any:
    deadline = time.monotonic() + timeout
    while not (found := check()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"WR: {what} not reached in {timeout:.0f} s")
        time.sleep(0.05)
    return found


def _lease(client: TaskClient) -> Doc:
    doc = client.collection.database["relays"].find_one({"_id": "tasks"})
    return doc or {}


def _holder(client: TaskClient) -> str | None:
    """The host whose relay holds the lease (unexpired, by the server's clock)."""
    lease = _lease(client)
    expires = lease.get("expires_at")
    relay = lease.get("relay")
    if not isinstance(relay, str) or expires is None or expires <= client.now():
        return None
    return relay.split("/")[0]


def _ready(client: TaskClient, hosts: int) -> bool:
    """Every host handed its tasks by the relay, which counts them all as subscribers, and a
    standby appointed if this mtask has one."""
    beats = {w["_id"]: w.get("stream") or {} for w in client.workers()}
    if sum(b.get("mode") == "dispatched" for b in beats.values()) < hosts:
        return False
    holder = _holder(client)
    relay = beats.get(holder, {}).get("relay") or {} if holder else {}
    return relay.get("subscribers") == hosts


def _one_fault(mongod_socket: str, uri: str, fault: str, hosts: int, root: Path) -> Doc:
    database = f"wr_{fault.replace(' ', '_')}_{os.getpid()}"
    mongo: MongoClient[Doc] = MongoClient(uri, w="majority")
    mongo.drop_database(database)
    cluster = Hosts(mongod_socket, database, root)
    publisher: Publisher | None = None
    thawed, victim = False, ""
    try:
        with TaskClient(uri, database=database) as client:
            for i in range(hosts):
                cluster.start(f"h{i:02d}")
            _wait(lambda: _ready(client, hosts), what="every host dispatched")
            time.sleep(3.0)  # a standby appointed (its post taken) and watching
            holder = _wait(lambda: _holder(client), what="a relay")
            lingering = [f"l{i}" for i in range(4)]
            client.publish_many(
                {"name": "linger", "key": k, "params": {"ms": LINGER_MS},
                 "options": {"worker_timeout_ms": LEASE_MS, "ping_interval_ms": 300}}
                for k in lingering
            )  # fmt: skip
            _wait(
                lambda: (
                    client.collection.count_documents(
                        {"_id": {"$in": lingering}, "status": "running"}
                    )
                    == 4
                ),
                what="the linger tasks running",
            )
            held = [
                d["_id"]
                for d in client.collection.find({"_id": {"$in": lingering}}, {"runs": 1})
                if d["runs"][0]["worker_id"] == holder
            ]
            publisher = Publisher(uri, database)
            publisher.start()
            time.sleep(2.0)
            victim = holder
            standby = str(_lease(client).get("standby") or "")  # (as the fault finds it)
            if fault == "subscriber cut off":
                victim = next(h for h in sorted(cluster.workers) if h not in (holder, standby))
            faulted = time.time()
            if fault == "killed":
                cluster.signal(victim, signal.SIGKILL)
            elif fault == "frozen":
                cluster.signal(victim, signal.SIGSTOP)
            else:
                cluster.signal(victim, signal.SIGSTOP, proxy=True)
            successor = None
            while time.time() < faulted + WINDOW + 1.0:
                if successor is None and _holder(client) not in (None, holder):
                    successor = _holder(client)
                time.sleep(0.05)
            published = publisher.stop()
            publisher = None
            if fault != "killed":
                cluster.signal(victim, signal.SIGCONT, proxy=fault != "frozen")
            thawed = True
            keys = [k for k, _ in published] + lingering
            _wait(
                lambda: (
                    client.collection.count_documents({"_id": {"$in": keys}, "status": "succeeded"})
                    == len(keys)
                ),
                timeout=180,
                what="every task succeeded",
            )
            docs = {
                d["_id"]: d
                for d in client.collection.find({"_id": {"$in": keys}}, {"result": 1, "runs": 1})
            }
    finally:
        if publisher is not None:
            publisher.stop()
        if victim and not thawed:
            with contextlib.suppress(KeyError):
                cluster.signal(victim, signal.SIGCONT)
                cluster.signal(victim, signal.SIGCONT, proxy=True)
        cluster.close()
        mongo.drop_database(database)
        mongo.close()
    during = [(k, t) for k, t in published if faulted <= t <= faulted + WINDOW]
    claims = [_seconds(docs[k]["runs"][0]["claimed_at"]) - t for k, t in during]
    starts = [docs[k]["result"] - t for k, t in during]
    before = [docs[k]["result"] - t for k, t in published if t < faulted]
    takeover = [docs[k]["result"] - faulted for k in held]
    doubles = sum(
        1
        for d in docs.values()
        if sum(r.get("state") == "SUCCESS" for r in d.get("runs") or ()) != 1
    )
    return {
        "hosts": float(hosts),
        "during": float(len(during)),
        "wait_max_s": max(claims, default=0.0),
        "wait_p50_s": statistics.median(claims) if claims else 0.0,
        "wait_p99_s": pct(claims, 0.99) if claims else 0.0,
        "start_max_s": max(starts, default=0.0),
        "start_p50_s": statistics.median(starts) if starts else 0.0,
        "before_p50_s": statistics.median(before) if before else 0.0,
        "takeover_max_s": max(takeover, default=0.0),
        "holder_tasks": float(len(held)),
        "double_successes": float(doubles),
        "standby_took_over": float(bool(standby) and successor == standby),
    }


@contextlib.contextmanager
def _mongod() -> Iterator[tuple[str, str]]:
    """A mongod of the workload's own: its URI and its Unix socket."""
    import tempfile

    from mtask.embedded import EmbeddedMongo

    with tempfile.TemporaryDirectory(prefix="mtask-wr-") as tmp:
        mongod = EmbeddedMongo(tmp, cache_size_gb=0.5)
        uri = mongod.start()
        try:
            port = int(uri.split(":")[2].split("/")[0])
            yield uri, f"/tmp/mongodb-{port}.sock"
        finally:
            mongod.stop()


def relay_faults(bench: Bench) -> None:
    """WR: each fault on a cluster of its own; a row for each."""
    for tool in ("unshare", "socat"):
        if shutil.which(tool) is None:
            raise RuntimeError(f"WR needs {tool} to make hosts and cut them off")
    quick = bench.sizes.scale_large < 1_000_000
    hosts = int(os.environ.get("MTASK_WR_HOSTS", "4" if quick else "16"))
    faults = os.environ.get("MTASK_WR_FAULTS", ",".join(FAULTS)).split(",")
    import tempfile

    with _mongod() as (uri, socket), tempfile.TemporaryDirectory(prefix="mtask-wr-") as tmp:
        rows = [(fault, _one_fault(socket, uri, fault, hosts, Path(tmp))) for fault in faults]
    lease = LEASE_MS / 1000
    for fault, row in rows:
        relay_fault = fault != "subscriber cut off"
        met = row["wait_max_s"] <= 1.0 and row["double_successes"] == 0
        if relay_fault and row["holder_tasks"]:
            met = met and row["takeover_max_s"] <= lease + 1.0
        bench.record(
            Result(
                f"WR relay faults x{hosts}: {fault}",
                f"first claim of the {row['during']:.0f} tasks published during the fault: "
                f"max {row['wait_max_s']:.2f} s, p99 {row['wait_p99_s']:.2f} s, p50 "
                f"{row['wait_p50_s']:.3f} s; their handler's start: max {row['start_max_s']:.2f} "
                f"s, p50 {row['start_p50_s']:.3f} s (before the fault: p50 "
                f"{row['before_p50_s']:.3f} s)"
                + (
                    f"; the holder's {row['holder_tasks']:.0f} own tasks taken over after "
                    f"{row['takeover_max_s']:.2f} s at most"
                    f"; standby took over: {'yes' if row['standby_took_over'] else 'no'}"
                    if relay_fault
                    else ""
                )
                + f"; {row['double_successes']:.0f} tasks without exactly one success",
                f"≤ 1 s; holder's tasks ≤ lease ({lease:.0f} s) + 1 s; one success each",
                met,
                f"{hosts} hosts (network namespaces, a socat proxy each) x concurrency 4, the "
                f"sweep off, {RATE:.0f} tasks/s, own mongod",
                row,
            )
        )
