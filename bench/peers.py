"""Bench WQ, mtask beside arq on Redis in the same run (measured alike).

- **Drain** (W1's shape): ``n`` no-op jobs enqueued first, then one worker process at
  concurrency 64 (arq: ``max_jobs=64``) drains them. Both queues are measured the same way:
  each worker process counts its own jobs in its handler and writes a file when the n-th has
  finished (``bench/finish.py``); the harness waits for that file and reads neither broker
  during the drain. Two rates: **from the process's start** (``Popen``; its start-up in it)
  and **from the first job's start** (the handler's own clock), both to the n-th handler's
  end. After the worker stopped, the harness checks that the broker holds every outcome
  (mtask: ``succeeded``; arq: its results) and reads the span each recorded (mtask: first
  ``claimed_at`` → last ``finished_at``; arq: first ``start_time`` → last ``finish_time``),
  the figure WQ printed before. Full size runs 20,000 jobs and 2,000 (the quick size), three
  rounds each, alternating which queue goes first; quick runs 2,000 once.
- **Latency** (W2's shape): jobs published one at a time, 20 ms apart, to one idle worker;
  publish call → job start (both handlers return ``time.time()`` at their start).

arq 0.28 runs as shipped but for ``poll_delay`` 10 ms (its default, 500 ms, would put half a
second on its latency; bench/arq_app.py), on a ``redis-server`` of its own on loopback with
persistence off (``--save ''``, no append-only file): no write waits for a disk or a replica,
where each of mtask's waits for its replica set's majority (journaled).

``MTASK_WQ_LEVERS="--prefetch 0;--loop asyncio"`` adds, in each round, an mtask drain with
each set of worker options, beside the same round's arq drain; ``MTASK_WQ_SIZES=20000`` runs
that size only. ``MTASK_WQ_POLL=1`` measures as
WQ did before its brokers were measured alike, to show what that cost: during each
drain the harness polls arq's Redis with ``KEYS arq:result:*`` every 0.2 s, and mtask's server
with a count by name every second. Nothing is judged here but the target's line: the figures
and their ratios are printed; a full run's are in bench/results.md, what bounds them in
docs/performance.md (WQ) and the dated runs in docs/journal/2026-11.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.finish import COUNT, FILE
from bench.support import LOOP, ROOT, Result, pct, runs_span, stop_process, wait_until
from mtask.client import TaskClient

if TYPE_CHECKING:
    from arq.connections import ArqRedis

    from bench.workloads import Bench

MAX_JOBS = 64
BIN = Path(sys.executable).parent


def child_env(**more: str) -> dict[str, str]:
    """A worker's environment: bytecode written and read, as in an installed package; the
    bench's modules importable (after any ``PYTHONPATH`` given: another tree's ``mtask`` for an
    A/B)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    path = os.pathsep.join(filter(None, [env.get("PYTHONPATH"), str(ROOT)]))
    return {**env, "PYTHONPATH": path, **more}


def script(name: str, module: str) -> list[str]:
    """The console script ``name`` beside this interpreter (what a user runs), else
    ``python -m module``."""
    found = BIN / name
    return [str(found)] if found.exists() else [sys.executable, "-m", module]


def mtask_worker(
    uri: str, database: str, *extra: str, env: dict[str, str]
) -> subprocess.Popen[bytes]:
    argv = [*script("mtask-worker", "mtask.cli.worker"), "bench.peer_app:registry", "--uri", uri]
    argv += ["--database", database, "--log-level", "WARNING", "--loop", LOOP, *extra]
    return subprocess.Popen(argv, env=env, cwd=ROOT, stdin=subprocess.DEVNULL)


def arq_worker(port: int, env: dict[str, str]) -> subprocess.Popen[bytes]:
    env = {**env, "MTASK_ARQ_PORT": str(port), "MTASK_ARQ_MAX_JOBS": str(MAX_JOBS)}
    return subprocess.Popen(
        [*script("arq", "arq"), "bench.arq_app.WorkerSettings"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
        cwd=ROOT,
    )


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


@dataclass
class Drain:
    """One drain of ``n`` jobs: wall-clock times (``time.time()``, one host)."""

    n: int
    began: float
    """Just before the worker process started."""
    first: float
    """The first handler's start, in the worker."""
    last: float
    """The n-th handler's end, in the worker."""
    span: float
    """The broker's own record, read after the worker stopped: first start → last finish."""
    worker_cpu: float
    """The worker process's CPU seconds from its first job to its n-th (every thread's)."""
    broker_cpu: float
    """The broker's (mongod's, redis-server's) CPU seconds from the worker's start to the
    finish line (0 where its process is not on this host)."""

    @property
    def from_start(self) -> float:
        return self.n / (self.last - self.began)

    @property
    def from_first(self) -> float:
        return self.n / (self.last - self.first)

    @property
    def recorded(self) -> float:
        return self.n / self.span


def _finish(path: Path, proc: subprocess.Popen[bytes], poll: Callable[[], None] | None) -> Any:
    """Wait for the worker's finish line (a file), looking at nothing else but its process;
    ``poll``: the old WQ's reads of the broker, every 0.2 s."""
    next_poll = time.monotonic() + 0.2
    while not path.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"the worker exited ({proc.returncode}) during a drain")
        if poll is not None and time.monotonic() >= next_poll:
            poll()
            next_poll += 0.2
        time.sleep(0.005)
    return json.loads(path.read_text())


def cpu_seconds(pid: int | None) -> float:
    """A process's user + system CPU seconds so far (``/proc``; 0 where it is not here)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _mtask_drain(bench: Bench, n: int, poll: bool, *extra: str) -> Drain:
    mongod = int(bench.mongo.admin.command("serverStatus")["pid"])
    name = bench.db()
    with TaskClient(bench.uri, database=name) as client:
        client.init_collection()  # the worker's own start would make them: not in a drain
        client.publish_many({"name": "noop", "key": f"d{i}"} for i in range(n))
    tasks = bench.mongo[name]["tasks"]
    polls = [0]

    def count() -> None:  # the old WQ: a count by name every second (5 polls)
        polls[0] += 1
        if polls[0] % 5 == 0:
            tasks.count_documents({"name": "noop", "status": "succeeded"})

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "finish.json"
        env = child_env(**{FILE: str(path), COUNT: str(n)})
        broker, began = cpu_seconds(mongod), time.time()
        proc = mtask_worker(bench.uri, name, "--concurrency", str(MAX_JOBS), *extra, env=env)
        try:
            line = _finish(path, proc, count if poll else None)
            broker = cpu_seconds(mongod) - broker
        finally:
            stop_process(proc)
    done = tasks.count_documents({"name": "noop", "status": "succeeded"})
    spanned = runs_span(tasks)
    bench.drop(name)
    if done != n:
        raise RuntimeError(f"mtask recorded {done} of {n} outcomes")
    return Drain(n, began, line["first"], line["last"], spanned, line["cpu"], broker)


async def _pool(port: int) -> ArqRedis:
    from arq import create_pool
    from arq.connections import RedisSettings

    return await create_pool(RedisSettings(port=port))


async def _arq_drain(port: int, n: int, poll: bool) -> Drain:
    redis = await _pool(port)
    server = int((await redis.info("server"))["process_id"])
    try:
        await redis.flushall()
        for start in range(0, n, 1000):
            await asyncio.gather(
                *(redis.enqueue_job("noop") for _ in range(start, min(n, start + 1000)))
            )
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "finish.json"
            env = child_env(**{FILE: str(path), COUNT: str(n)})
            broker, began = cpu_seconds(server), time.time()
            proc = arq_worker(port, env)
            try:
                line = await asyncio.to_thread(
                    _finish, path, proc, _keys_poll(port) if poll else None
                )
                broker = cpu_seconds(server) - broker
            finally:
                stop_process(proc)
        results = await redis.all_job_results()
        if len(results) != n:
            raise RuntimeError(f"arq recorded {len(results)} of {n} results")
        began_at = min(r.start_time for r in results)
        ended_at = max(r.finish_time for r in results)
        spanned = (ended_at - began_at).total_seconds()
        return Drain(n, began, line["first"], line["last"], spanned, line["cpu"], broker)
    finally:
        await redis.aclose()


def _keys_poll(port: int) -> Callable[[], None]:
    """The old WQ's wait for arq: ``KEYS arq:result:*`` (every 0.2 s), in a plain client."""
    import redis

    client = redis.Redis(port=port)
    lock = threading.Lock()

    def poll() -> None:
        with lock:
            client.keys("arq:result:*")

    return poll


async def _arq_latency(port: int, n: int) -> list[float]:
    redis = await _pool(port)
    proc = arq_worker(port, child_env())
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


def drains(bench: Bench, port: int, n: int, rounds: int, poll: bool) -> dict[str, list[Drain]]:
    """``rounds`` drains of ``n`` jobs each side, alternating which goes first; then, in each
    round, one mtask drain for each lever ``MTASK_WQ_LEVERS`` names (``;``-separated sets of
    worker options, e.g. ``--prefetch 0;--loop asyncio``), keyed by its options."""
    levers = [lever.split() for lever in os.environ.get("MTASK_WQ_LEVERS", "").split(";")]
    seen: dict[str, list[Drain]] = {"mtask": [], "arq": []}
    for r in range(rounds):
        for who in ("mtask", "arq") if r % 2 == 0 else ("arq", "mtask"):
            if who == "mtask":
                seen["mtask"].append(_mtask_drain(bench, n, poll))
            else:
                seen["arq"].append(asyncio.run(_arq_drain(port, n, poll)))
        for lever in filter(None, levers):
            seen.setdefault(" ".join(lever), []).append(_mtask_drain(bench, n, poll, *lever))
    return seen


def ratios(
    seen: dict[str, list[Drain]], rate: Callable[[Drain], float], side: str = "mtask"
) -> tuple[float, float, float]:
    """``side``'s median rate (mtask's, or a lever's), arq's, and the median of the rounds'
    ratios."""
    pairs = zip(seen[side], seen["arq"], strict=True)
    return (
        statistics.median(rate(d) for d in seen[side]),
        statistics.median(rate(d) for d in seen["arq"]),
        statistics.median(rate(m) / rate(a) for m, a in pairs),
    )


RATES: list[tuple[str, str, Callable[[Drain], float]]] = [
    ("first", "from the first job", lambda d: d.from_first),
    ("start", "from the start", lambda d: d.from_start),
    ("recorded", "brokers' records", lambda d: d.recorded),
]


def _describe(n: int, seen: dict[str, list[Drain]]) -> tuple[str, dict[str, float]]:
    values: dict[str, float] = {}
    parts = []
    for key, label, rate in RATES:
        m, a, ratio = ratios(seen, rate)
        pairs = zip(seen["mtask"], seen["arq"], strict=True)
        each = ", ".join(f"{rate(x) / rate(y):.2f}" for x, y in pairs)
        parts.append(f"{label} {m:,.0f}/{a:,.0f}/s = {ratio:.2f}x ({each})")
        values |= {f"mtask_{key}_{n}": m, f"arq_{key}_{n}": a, f"ratio_{key}_{n}": ratio}
    cpu = {
        who: [
            statistics.median(d.worker_cpu / d.n * 1e6 for d in seen[who]),
            statistics.median(d.broker_cpu / d.n * 1e6 for d in seen[who]),
        ]
        for who in ("mtask", "arq")
    }
    parts.append(
        f"CPU a job, worker + broker: mtask {cpu['mtask'][0]:.0f} + {cpu['mtask'][1]:.0f} µs, "
        f"arq {cpu['arq'][0]:.0f} + {cpu['arq'][1]:.0f} µs"
    )
    for who, (worker, broker) in cpu.items():
        values |= {f"{who}_worker_us_{n}": worker, f"{who}_broker_us_{n}": broker}
    for lever in seen.keys() - {"mtask", "arq"}:
        m, _, ratio = ratios(seen, lambda d: d.from_first, lever)
        pairs = zip(seen[lever], seen["arq"], strict=True)
        each = ", ".join(f"{x.from_first / y.from_first:.2f}" for x, y in pairs)
        worker = statistics.median(d.worker_cpu / d.n * 1e6 for d in seen[lever])
        broker = statistics.median(d.broker_cpu / d.n * 1e6 for d in seen[lever])
        parts.append(
            f"with {lever}: {m:,.0f}/s = {ratio:.2f}x from the first job ({each}), CPU a job "
            f"{worker:.0f} + {broker:.0f} µs"
        )
        values |= {f"mtask_first_{n}_{lever}": m, f"ratio_first_{n}_{lever}": ratio}
    return f"{n:,}: " + ", ".join(parts), values


def peers(bench: Bench) -> None:
    quick = bench.sizes.scale_large < 1_000_000  # by value (see bench.scale._quick)
    if shutil.which("redis-server") is None or not _has_arq():
        if os.environ.get("CI") == "true":
            raise RuntimeError("bench WQ needs redis-server (Debian) and arq (PyPI)")
        bench.record(Result("WQ beside arq", "skipped", "-", None, "no redis-server or arq here"))
        return
    sizes: tuple[int, ...] = (2_000,) if quick else (20_000, 2_000)
    rounds, m = (1, 40) if quick else (3, 300)
    if os.environ.get("MTASK_WQ_SIZES"):  # e.g. 20000: one size only (a lever's A/B)
        sizes = tuple(int(size) for size in os.environ["MTASK_WQ_SIZES"].split(","))
    poll = os.environ.get("MTASK_WQ_POLL") == "1"
    figures: list[str] = []
    values: dict[str, float] = {}
    with redis_server() as port:
        for n in sizes:
            said, more = _describe(n, drains(bench, port, n, rounds, poll))
            figures.append(said)
            values |= more
        lat = {"mtask": bench.latencies(m), "arq": asyncio.run(_arq_latency(port, m))}
    n = sizes[0]
    values |= {"mtask_p50": pct(lat["mtask"], 0.5), "arq_p50": pct(lat["arq"], 0.5)}
    figure = (
        "drain mtask/arq " + "; ".join(figures) + f"; latency p50/p99 mtask "
        f"{pct(lat['mtask'], 0.5):.1f}/{pct(lat['mtask'], 0.99):.1f} ms, arq "
        f"{pct(lat['arq'], 0.5):.1f}/{pct(lat['arq'], 0.99):.1f} ms"
    )
    met = values[f"ratio_first_{n}"] >= 2.5 and values["mtask_p50"] < values["arq_p50"]
    bench.record(
        Result(
            "WQ beside arq",
            figure,
            "drain ≥ 2.5x arq from the first job, p50 below arq's",
            met,
            f"no-op jobs drained by one worker process at concurrency 64, {rounds} round(s) "
            "alternated, completion counted in each worker process (per-round median ratio)"
            f"{'; brokers polled as they once were' if poll else ''}; {m} jobs 20 ms apart; "
            "arq 0.28 with poll_delay 10 ms on its own redis-server (persistence off), mtask "
            "on the bench's replica set (majority writes)",
            values,
        )
    )


def _has_arq() -> bool:
    try:
        import arq  # noqa: F401
    except ImportError:
        return False
    return True
