"""Sizes, results and the process helpers the workloads share."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pymongo import MongoClient

from mtask.client import TaskClient
from mtask.testing import worker_argv

ROOT = Path(__file__).resolve().parents[1]  # the repository: `bench` imports from there
# The workers' event loop (`mtask-worker --loop`): by default what users run; an A/B of the
# loop sets MTASK_BENCH_LOOP=asyncio for one of its runs
LOOP = os.environ.get("MTASK_BENCH_LOOP", "auto")


@dataclass
class Sizes:
    baseline: int
    drain: int
    latency: int
    takeover: int
    scale_small: int
    scale_large: int
    stampede: int
    publish: int


FULL = Sizes(20_000, 50_000, 300, 20, 10_000, 1_000_000, 1_000, 20_000)
QUICK = Sizes(2_000, 3_000, 40, 20, 2_000, 20_000, 40, 2_000)


@dataclass
class Result:
    name: str
    figure: str
    target: str
    met: bool | None
    notes: str = ""
    values: dict[str, float] = field(default_factory=dict)


def runs_span(tasks: Any) -> float:
    """Seconds from the first run's claim to the last one's finish in a tasks collection (the
    server's own times: the runs' ``claimed_at`` and ``finished_at``)."""
    span = next(
        tasks.aggregate(
            [
                {"$unwind": "$runs"},
                {
                    "$group": {
                        "_id": None,
                        "a": {"$min": "$runs.claimed_at"},
                        "b": {"$max": "$runs.finished_at"},
                    }
                },
            ]
        )
    )
    return float((span["b"] - span["a"]).total_seconds())


def alternated(
    modes: Sequence[str], rounds: int, one: Callable[[str, int], dict[str, float]]
) -> dict[str, list[dict[str, float]]]:
    """Each mode's figures over ``rounds`` rounds (``one(mode, round)``), the modes' order
    reversed every other round so that none is always first."""
    figures: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    for r in range(rounds):
        for mode in modes if r % 2 == 0 else list(reversed(modes)):
            figures[mode].append(one(mode, r))
    return figures


def medians(figures: Mapping[str, list[dict[str, float]]]) -> Callable[[str, str], float]:
    """``median(mode, key)``: the median over the rounds of one figure of a mode."""

    def median(mode: str, key: str) -> float:
        return statistics.median(f[key] for f in figures[mode])

    return median


def server_ops(mongo: MongoClient[dict[str, Any]]) -> int:
    """The server's operations so far (inserts, queries, updates and commands)."""
    counters = mongo.admin.command("serverStatus")["opcounters"]
    return sum(int(counters[k]) for k in ("insert", "query", "update", "command"))


def cost_reading(
    worker_pid: int, mongod_pid: int, mongo: MongoClient[dict[str, Any]]
) -> tuple[float, float, int]:
    """The worker's CPU seconds (its process tree), mongod's, and the server's operations."""
    from bench.cpu import tree_cpu_seconds
    from bench.scale import _cpu_s

    return tree_cpu_seconds(worker_pid), _cpu_s(mongod_pid), server_ops(mongo)


def per_task(
    before: tuple[float, float, int],
    after: tuple[float, float, int],
    n: int,
    own_ops: float,
    wall: float,
) -> dict[str, float]:
    """Between two ``cost_reading``s: the worker's and mongod's CPU µs and the server's
    operations per task of ``n`` (less ``own_ops``, the bench's own), and the ``wall`` time."""
    (w0, m0, o0), (w1, m1, o1) = before, after
    return {
        "worker_us": (w1 - w0) * 1e6 / n,
        "mongod_us": (m1 - m0) * 1e6 / n,
        "ops": (o1 - o0 - own_ops) / n,
        "wall": wall,
    }


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def spawn_worker(
    uri: str, database: str, *extra: str, env: Mapping[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """A worker process of ``bench.app``; ``env``: more environment for it (e.g. WB's
    ``MTASK_BENCH_OFF``)."""
    return subprocess.Popen(
        worker_argv("bench.app:registry", uri, database, "--loop", LOOP, *extra),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        cwd=ROOT,
        env=None if env is None else {**os.environ, **env},
    )


@contextlib.contextmanager
def worker_and_client(
    uri: str, database: str, *extra: str, env: Mapping[str, str] | None = None
) -> Iterator[tuple[subprocess.Popen[bytes], TaskClient]]:
    """A worker process on ``database`` (``extra``, ``env``: as ``spawn_worker``) and a client
    of it, once the worker is up; the worker stopped after."""
    proc = spawn_worker(uri, database, *extra, env=env)
    try:
        with TaskClient(uri, database=database) as client:
            wait_for_worker(client, proc)
            yield proc, client
    finally:
        stop_process(proc)


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_until(check: Callable[[], bool], timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError("benchmark condition not reached in time")
        time.sleep(0.05)


def wait_for_worker(client: TaskClient, proc: subprocess.Popen[bytes], count: int = 1) -> None:
    wait_until(lambda: len(client.workers()) >= count or proc.poll() is not None, timeout=60)
    if proc.poll() is not None:
        raise RuntimeError("the benchmark worker exited")
    time.sleep(0.5)  # its change stream and first scan


def peak_rss_kb(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def mem_gib() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        return 0.0


def floor_helper(uri: str, database: str, count: str) -> int:
    """The other process of the W2 floor: wait for each insert's event, claim it, report."""
    client: MongoClient[dict[str, Any]] = MongoClient(uri, w="majority")
    coll = client[database]["floor"]
    took: list[float] = []
    with coll.watch([{"$match": {"operationType": "insert"}}], max_await_time_ms=200) as stream:
        print("ready", flush=True)
        while len(took) < int(count):
            change = stream.try_next()
            if change is None:
                continue
            doc = change["fullDocument"]
            coll.find_one_and_update({"_id": doc["_id"], "s": 0}, {"$set": {"s": 1}})
            took.append((time.time() - doc["t"]) * 1000)
    print(json.dumps(took), flush=True)
    return 0
