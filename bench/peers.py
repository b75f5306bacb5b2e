"""Bench WQ, mtask beside arq on Redis in the same run (issue 26).

- **Drain** (W1's shape): ``n`` no-op jobs enqueued first, then one worker process at
  concurrency 64 (arq: ``max_jobs=64``) drains them; the rate runs from the first job's start
  to the last one's finish (mtask: the runs' own times; arq: its job results' ``start_time``
  and ``finish_time``). Rounds alternate which queue goes first.
- **Latency** (W2's shape): jobs published one at a time, 20 ms apart, to one idle worker;
  publish call → job start (both handlers return ``time.time()`` at their start).

arq 0.28 runs as shipped but for ``poll_delay`` 10 ms (its default, 500 ms, would put half a
second on its latency; bench/arq_app.py), on a ``redis-server`` of its own on loopback with
persistence off (``--save ''``, no append-only file): no write waits for a disk or a replica,
where each of mtask's waits for its replica set's majority (journaled). Nothing is judged here:
the figures and their ratios are printed, and docs/performance.md carries a full-size run.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from bench.support import ROOT, Result, pct, stop_process, wait_until

if TYPE_CHECKING:
    from arq.connections import ArqRedis

    from bench.workloads import Bench

MAX_JOBS = 64


@contextlib.contextmanager
def redis_server() -> Iterator[int]:
    """A ``redis-server`` of the bench's own on 127.0.0.1: its port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    proc = subprocess.Popen(
        [
            "redis-server",
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ],
        stdout=subprocess.DEVNULL,
    )
    try:

        def up() -> bool:
            with socket.socket() as s:
                return s.connect_ex(("127.0.0.1", port)) == 0

        wait_until(up, timeout=20)
        yield port
    finally:
        stop_process(proc)


def _arq_worker(port: int) -> subprocess.Popen[bytes]:
    env = {**os.environ, "MTASK_ARQ_PORT": str(port), "MTASK_ARQ_MAX_JOBS": str(MAX_JOBS)}
    return subprocess.Popen(
        [sys.executable, "-m", "arq", "bench.arq_app.WorkerSettings"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
        cwd=ROOT,
    )


async def _pool(port: int) -> ArqRedis:
    from arq import create_pool
    from arq.connections import RedisSettings

    return await create_pool(RedisSettings(port=port))


async def _arq_drain(port: int, n: int) -> float:
    redis = await _pool(port)
    try:
        await redis.flushall()
        for start in range(0, n, 1000):
            await asyncio.gather(
                *(redis.enqueue_job("noop") for _ in range(start, min(n, start + 1000)))
            )
        proc = _arq_worker(port)
        try:
            while len(await redis.keys("arq:result:*")) < n:
                if proc.poll() is not None:
                    raise RuntimeError("the arq worker exited during a drain")
                await asyncio.sleep(0.2)
        finally:
            stop_process(proc)
        results = await redis.all_job_results()
        began = min(r.start_time for r in results)
        ended = max(r.finish_time for r in results)
        return n / (ended - began).total_seconds()
    finally:
        await redis.aclose()


async def _arq_latency(port: int, n: int) -> list[float]:
    redis = await _pool(port)
    proc = _arq_worker(port)
    try:
        await redis.flushall()
        warm = await redis.enqueue_job("noop")
        assert warm is not None
        await warm.result(timeout=30)
        published = []
        for _ in range(n):
            at = time.time()
            job = await redis.enqueue_job("stamp")
            assert job is not None
            published.append((job, at))
            await asyncio.sleep(0.02)
        return [(float(await job.result(timeout=30)) - at) * 1000 for job, at in published]
    finally:
        stop_process(proc)
        await redis.aclose()


def peers(bench: Bench) -> None:
    quick = bench.sizes.scale_large < 1_000_000  # by value (see bench.scale._quick)
    if shutil.which("redis-server") is None or not _has_arq():
        if os.environ.get("CI") == "true":
            raise RuntimeError("bench WQ needs redis-server (Debian) and arq (PyPI)")
        bench.record(Result("WQ beside arq", "skipped", "-", None, "no redis-server or arq here"))
        return
    n, rounds, m = (2_000, 1, 40) if quick else (20_000, 3, 300)
    drains: dict[str, list[float]] = {"mtask": [], "arq": []}
    with redis_server() as port:
        for r in range(rounds):
            order = ("mtask", "arq") if r % 2 == 0 else ("arq", "mtask")
            for who in order:
                if who == "mtask":
                    drains["mtask"].append(bench.drain("noop", n)[0])
                else:
                    drains["arq"].append(asyncio.run(_arq_drain(port, n)))
        lat = {"mtask": bench.latencies(m), "arq": asyncio.run(_arq_latency(port, m))}
    ratios = [a / b for a, b in zip(drains["mtask"], drains["arq"], strict=True)]
    figure = (
        f"drain mtask {statistics.median(drains['mtask']):,.0f}/s, arq "
        f"{statistics.median(drains['arq']):,.0f}/s = {statistics.median(ratios):.2f}x "
        f"(per-round median); latency p50/p99 mtask {pct(lat['mtask'], 0.5):.1f}/"
        f"{pct(lat['mtask'], 0.99):.1f} ms, arq {pct(lat['arq'], 0.5):.1f}/"
        f"{pct(lat['arq'], 0.99):.1f} ms"
    )
    met = statistics.median(ratios) >= 2.5 and pct(lat["mtask"], 0.5) < pct(lat["arq"], 0.5)
    bench.record(
        Result(
            "WQ beside arq",
            figure,
            "drain ≥ 2.5x arq, p50 below arq's (issue 26)",
            met,
            f"{n:,} no-op jobs drained at concurrency 64, {rounds} round(s) alternated; {m} "
            "jobs 20 ms apart; arq 0.28 with poll_delay 10 ms on its own redis-server "
            "(persistence off), mtask on the bench's replica set (majority writes)",
            {
                "mtask_drain": statistics.median(drains["mtask"]),
                "arq_drain": statistics.median(drains["arq"]),
                "drain_ratio": statistics.median(ratios),
                "mtask_p50": pct(lat["mtask"], 0.5),
                "arq_p50": pct(lat["arq"], 0.5),
            },
        )
    )


def _has_arq() -> bool:
    try:
        import arq  # noqa: F401
    except ImportError:
        return False
    return True
