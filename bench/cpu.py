"""Bench W10, CPU-bound handlers: the thread pool against the process pool.

``cpu`` burns about 20 ms of pure-Python CPU (a loop calibrated on this host). One
``mtask-worker`` at concurrency 2 (``--prefetch 2``: the next runs are claimed while the slots
are busy) drains the same number of them with ``--pool thread`` and with ``--pool process``, in
rounds that alternate which goes first (the machine is shared: only ratios measured side by
side mean anything); the target is a process-pool throughput of at least 1.6x the thread
pool's (threads share one GIL). Each round also drains with ``--pool process --prefetch 0``
(a slot idles a claim round trip after each run), and reads the CPU time the worker and its
children used per task (``/proc``: what the load of other processes does not change).

The process pool's per-task overhead on no-op plain-def handlers is measured twice: the pool's
own round trip (``ProcessPool.run`` against a thread, in this process, no MongoDB), and the
drain rate of no-op tasks at concurrency 2 with ``--pool process`` against ``--pool thread``
(set against W1's rate when W1 ran in the same session).
"""

from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any

from bench.support import QUICK, ROOT, Result, runs_span, stop_process, wait_until
from mtask.client import TaskClient
from mtask.registry import Registry
from mtask.worker.running.invoke import run_in_thread
from mtask.worker.running.pool.pipe import RunInfo
from mtask.worker.running.pool.pool import ProcessPool

if TYPE_CHECKING:
    from bench.workloads import Bench

registry = Registry()
TARGET_MS = 20.0
FULL_TASKS, QUICK_TASKS = 2_000, 100
FULL_ROUNDS, QUICK_ROUNDS = 3, 1
PREFETCH = 2
ROUND_TRIPS = 500


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
    """Loops of ``cpu`` that take about ``target_ms`` of CPU on this host (best of five, timed
    by this thread's CPU clock: on a loaded machine the wall clock also counts the time other
    processes had the core, which made the loop too short)."""
    loops = 100_000
    best = min(_timed(loops) for _ in range(5))
    return max(1, round(loops * target_ms / (best * 1000)))


def _timed(loops: int) -> float:
    start = time.thread_time()
    cpu({"loops": loops})
    return time.thread_time() - start


def drain(
    bench: Bench, task: str, n: int, pool: str, params: dict[str, Any], prefetch: int = PREFETCH
) -> tuple[float, float]:
    """Tasks per second (first claim to last finish, on the server's clock) of one worker at
    concurrency 2, and the CPU milliseconds per task of the worker and its children."""
    name = bench.db()
    with TaskClient(bench.uri, database=name) as client:
        client.publish_many({"name": task, "key": f"c{i}", "params": params} for i in range(n))
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "mtask", "worker", "run", "bench.cpu:registry"),
            *("--uri", bench.uri, "--database", name, "--log-level", "WARNING"),
            *("--concurrency", "2", "--pool", pool, "--prefetch", str(prefetch)),
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        cwd=ROOT,
    )
    try:
        counts = bench.mongo[name]["tasks"]
        wait_until(lambda: counts.count_documents({"name": task, "status": "succeeded"}) >= n)
        cpu_s = tree_cpu_seconds(proc.pid)
    finally:
        stop_process(proc)
    seconds = runs_span(bench.mongo[name]["tasks"])
    bench.drop(name)
    return n / seconds, cpu_s * 1000 / n


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and its live descendants (the forkserver, the
    pool's children), start-up included."""
    parents: dict[int, list[int]] = {}
    times: dict[int, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents.setdefault(int(fields[1]), []).append(int(entry))
        times[int(entry)] = (int(fields[11]) + int(fields[12])) / tick
    total, todo = 0.0, [pid]
    while todo:
        current = todo.pop()
        total += times.get(current, 0.0)
        todo.extend(parents.get(current, ()))
    return total


def load() -> str:
    return "/".join(f"{x:.0f}" for x in os.getloadavg())


def w10_cpu(bench: Bench) -> None:
    quick = bench.sizes is QUICK
    n = QUICK_TASKS if quick else FULL_TASKS
    rounds = QUICK_ROUNDS if quick else FULL_ROUNDS
    loops = calibrate()
    params = {"loops": loops}
    loads = [load()]
    runs: dict[str, list[tuple[float, float]]] = {"thread": [], "process": [], "process0": []}
    for r in range(rounds):
        order = ["thread", "process", "process0"]
        for kind in order if r % 2 == 0 else order[::-1]:
            pool, prefetch = ("process", 0) if kind == "process0" else (kind, PREFETCH)
            runs[kind].append(drain(bench, "cpu", n, pool, params, prefetch))
        loads.append(load())
    ratios = [p[0] / t[0] for p, t in zip(runs["process"], runs["thread"], strict=True)]
    ratios0 = [p[0] / t[0] for p, t in zip(runs["process0"], runs["thread"], strict=True)]
    ratio = statistics.median(ratios)
    cpu_t = statistics.median(c for _, c in runs["thread"])
    cpu_p = statistics.median(c for _, c in runs["process"])
    bench.record(
        Result(
            "W10 CPU-bound",
            f"process pool {ratio:.2f}x the thread pool (median of {rounds} rounds: "
            f"{', '.join(f'{x:.2f}' for x in ratios)}); "
            f"{statistics.median(p for p, _ in runs['process']):,.1f} vs "
            f"{statistics.median(t for t, _ in runs['thread']):,.1f} tasks/s; "
            f"without prefetch {', '.join(f'{x:.2f}' for x in ratios0)}",
            "≥ 1.6x",
            ratio >= 1.6,
            f"{n:,} tasks x ~{TARGET_MS:.0f} ms pure-Python CPU ({loops:,} loops), one worker, "
            f"concurrency 2, --prefetch {PREFETCH}, A/B alternated; CPU per task (worker + "
            f"children, start-up included) thread {cpu_t:.1f} ms, process {cpu_p:.1f} ms; "
            f"load average (1/5/15 min) per round: {' → '.join(loads)}",
            {"ratio": ratio, "ratio_no_prefetch": statistics.median(ratios0)},
        )
    )
    trip_p, trip_t = pool_round_trip()
    noop: dict[str, list[float]] = {"thread": [], "process": []}
    for r in range(rounds):
        for pool in ("thread", "process") if r % 2 == 0 else ("process", "thread"):
            noop[pool].append(drain(bench, "noop_def", n, pool, {})[0])
    per_task = [  # the extra time one slot spends per task
        (1 / p - 1 / t) * 1000 * 2 for p, t in zip(noop["process"], noop["thread"], strict=True)
    ]
    w1 = next((r.values["per_s"] for r in bench.results if r.name == "W1 drain"), None)
    against_w1 = "" if w1 is None else f"; W1 (async no-op, concurrency 64): {w1:,.0f} tasks/s"
    overhead = trip_p - trip_t
    bench.record(
        Result(
            "W10 process-pool overhead",
            f"pool round trip {trip_p:.3f} ms vs thread {trip_t:.3f} ms: {overhead:.3f} ms per "
            f"task; in a worker (no-op drains, per slot): "
            f"{', '.join(f'{x:+.2f}' for x in per_task)} ms "
            f"({statistics.median(noop['process']):,.0f} vs "
            f"{statistics.median(noop['thread']):,.0f} tasks/s){against_w1}",
            "< 1 ms per task",
            overhead < 1.0,
            f"no-op plain-def handlers; round trip: median of 5 alternated batches of "
            f"{ROUND_TRIPS} sequential calls in this process; drains: {n:,} tasks, "
            f"concurrency 2, --prefetch {PREFETCH}",
            {"overhead_ms": overhead, "drain_overhead_ms": statistics.median(per_task)},
        )
    )


def pool_round_trip() -> tuple[float, float]:
    """Milliseconds per no-op call: through a pool child, and on a thread (as the thread pool
    runs a plain def). Median of five alternated batches."""

    async def measure() -> tuple[float, float]:
        handler = registry["noop_def"]
        pool = ProcessPool()
        info = RunInfo("k", "noop_def", 1, "run", "bench")
        cancelled = asyncio.Event()
        try:
            await pool.run(handler, {}, info, cancelled=cancelled)  # the child starts
            trips: dict[str, list[float]] = {"process": [], "thread": []}
            for _ in range(5):
                began = time.perf_counter()
                for _ in range(ROUND_TRIPS):
                    await pool.run(handler, {}, info, cancelled=cancelled)
                trips["process"].append((time.perf_counter() - began) / ROUND_TRIPS * 1000)
                began = time.perf_counter()
                for _ in range(ROUND_TRIPS):
                    await run_in_thread(handler.fn, {}, name="bench")
                trips["thread"].append((time.perf_counter() - began) / ROUND_TRIPS * 1000)
        finally:
            await pool.close()
        return statistics.median(trips["process"]), statistics.median(trips["thread"])

    return asyncio.run(measure())
