"""Bench W10, CPU-bound handlers: the thread pool against the process pool.

``cpu`` burns about 20 ms of pure-Python CPU (a loop calibrated on this host). One
``mtask-worker`` at concurrency 2 drains the same number of them with ``--pool thread`` and with
``--pool process``; the target is a process-pool throughput of at least 1.6x the thread pool's
(threads share one GIL). The process pool's per-task overhead is measured on no-op plain-def
handlers: the time per task at concurrency 2 with ``--pool process`` against ``--pool thread``,
and set against W1's no-op rate when W1 ran in the same session.
"""

from __future__ import annotations

import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any

from bench.support import QUICK, ROOT, Result, stop_process, wait_until
from mtask.client import TaskClient
from mtask.registry import Registry

if TYPE_CHECKING:
    from bench.workloads import Bench

registry = Registry()
TARGET_MS = 20.0
FULL_TASKS, QUICK_TASKS = 2_000, 100


@registry.task("cpu")
def cpu(params: dict[str, Any]) -> int:
    total = 0
    for i in range(int(params["loops"])):
        total += i * i
    return total % 7


@registry.task("noop_def")
def noop_def(params: dict[str, Any]) -> None:
    return None


def calibrate(target_ms: float = TARGET_MS) -> int:
    """Loops of ``cpu`` that take about ``target_ms`` on this host (best of five)."""
    loops = 100_000
    best = min(_timed(loops) for _ in range(5))
    return max(1, round(loops * target_ms / (best * 1000)))


def _timed(loops: int) -> float:
    start = time.perf_counter()
    cpu({"loops": loops})
    return time.perf_counter() - start


def drain(bench: Bench, task: str, n: int, pool: str, params: dict[str, Any]) -> float:
    """Tasks per second (first claim to last finish) of one worker at concurrency 2."""
    name = bench.db()
    with TaskClient(bench.uri, database=name) as client:
        client.publish_many({"name": task, "key": f"c{i}", "params": params} for i in range(n))
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "mtask", "worker", "run", "bench.cpu:registry"),
            *("--uri", bench.uri, "--database", name, "--log-level", "WARNING"),
            *("--concurrency", "2", "--pool", pool),
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        cwd=ROOT,
    )

    try:
        counts = bench.mongo[name]["tasks"]
        wait_until(lambda: counts.count_documents({"status": "succeeded"}) >= n)
    finally:
        stop_process(proc)
    span = next(
        bench.mongo[name]["tasks"].aggregate(
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
    bench.drop(name)
    return float(n / (span["b"] - span["a"]).total_seconds())


def w10_cpu(bench: Bench) -> None:
    n = QUICK_TASKS if bench.sizes is QUICK else FULL_TASKS
    loops = calibrate()
    threads = drain(bench, "cpu", n, "thread", {"loops": loops})
    processes = drain(bench, "cpu", n, "process", {"loops": loops})
    ratio = processes / threads
    bench.record(
        Result(
            "W10 CPU-bound",
            f"process pool {processes:,.1f} tasks/s = {ratio:.2f}x thread pool "
            f"({threads:,.1f} tasks/s)",
            "≥ 1.6x",
            ratio >= 1.6,
            f"{n:,} tasks x ~{TARGET_MS:.0f} ms pure-Python CPU ({loops:,} loops), one worker, "
            "concurrency 2",
            {"process_per_s": processes, "thread_per_s": threads, "ratio": ratio},
        )
    )
    noop_threads = drain(bench, "noop_def", n, "thread", {})
    noop_processes = drain(bench, "noop_def", n, "process", {})
    overhead_ms = (1 / noop_processes - 1 / noop_threads) * 1000 * 2  # per task, per slot
    w1 = next((r.values["per_s"] for r in bench.results if r.name == "W1 drain"), None)
    against_w1 = "" if w1 is None else f"; W1 (async no-op, concurrency 64): {w1:,.0f} tasks/s"
    bench.record(
        Result(
            "W10 process-pool overhead",
            f"{overhead_ms:.2f} ms per task ({noop_processes:,.0f} tasks/s in processes, "
            f"{noop_threads:,.0f} in threads, concurrency 2){against_w1}",
            "< 1 ms per task",
            overhead_ms < 1.0,
            "no-op plain-def handlers; overhead = the extra time per task of one slot",
            {"overhead_ms": overhead_ms, "process_per_s": noop_processes},
        )
    )
