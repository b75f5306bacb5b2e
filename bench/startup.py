"""Bench WST: how soon a worker process claims its first task, and how soon the command line
answers.

Each round runs every measurement once, in the same order, so that the machine's load (shared
with other work) falls on all of them alike; the first round is not counted (it writes the
bytecode caches, as ``pip install`` does). Every time is wall-clock, from just before the
process is started (``time.time()`` in the bench, on the same host as the server and the
worker):

- **worker, first claim**: a ``stamp`` task is due; ``mtask-worker bench.peer_app:registry``
  starts; the time is the run's ``claimed_at`` (the server's clock: the same host's) and the
  handler's own start (``time.time()`` in the worker). Indexes present (the collection has
  been used: a worker that scales from zero), and, in a few rounds, a new database (the first
  worker makes the indexes);
- **arq, first job**: the same with ``arq bench.arq_app.WorkerSettings`` (arq 0.28, poll 10 ms)
  on a ``redis-server`` of its own, the job enqueued first; the handler's start;
- ``mtask --help``, and ``mtask get KEY`` of a stored task, ``mtask list`` and ``mtask stats``
  (to their exit);
- **the driver's floor** (``FIND``): a bare PyMongo script that connects, reads the same task
  by its key and exits (without the driver's exit hook, as ``mtask`` exits): what any command
  line reading MongoDB in Python costs;
- ``python -c pass``: the interpreter's own start, the floor under every figure.

The targets are ratios to a peer measured in the same rounds: the worker's first claim at most
1.2x arq's first job, and ``mtask get``, ``list`` and ``stats`` at most 1.5x the driver's floor.

Each also reports its CPU time (user + system), which the machine's load stretches far less
than wall-clock. The processes are the console scripts next to the interpreter (``mtask``,
``mtask-worker``, ``arq``), as a user runs them. ``MTASK_STARTUP_ROUNDS`` sets the rounds
(default 15, quick 5); ``MTASK_STARTUP_BEFORE=/path/to/another/checkout`` measures that tree's
``mtask`` too, in the same rounds, each tree first in every other round (an A/B on a shared
machine: only figures of one run compare).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING

from bench.peers import arq_worker, child_env, cpu_seconds, redis_server, script
from bench.support import ROOT, Result, stop_process, wait_until
from mtask.client import TaskClient

if TYPE_CHECKING:
    from bench.workloads import Bench

FRESH_EVERY = 5
"""Every this many rounds, the worker also starts against a new database (no indexes yet)."""
FIND = (
    "import os, sys\n"
    "from pymongo import MongoClient\n"
    "client = MongoClient(sys.argv[1])\n"
    "print(client[sys.argv[2]]['tasks'].find_one({'_id': sys.argv[3]}))\n"
    "client.close()\n"
    "sys.stdout.flush()\n"
    "os._exit(0)"
)
"""The driver's floor: connect, read one task by its key, print it, exit."""
CLAIM_RATIO = 1.2
"""The target: a worker's first claim at most this many times arq's first job (medians)."""
CLI_RATIO = 1.5
"""The target: ``mtask get``, ``list`` and ``stats`` at most this many times the driver's
floor (medians)."""
CLI = ("get", "list", "stats")


def _timed(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
    """Seconds from the start of ``argv`` to its exit (status 0 required), and the CPU seconds
    it used (user and system: what the machine's load does not stretch)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    began = time.time()
    subprocess.run(argv, check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
    wall = time.time() - began
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime


def _first_claim(uri: str, database: str, env: dict[str, str]) -> tuple[float, float, float]:
    """A due ``stamp`` task, then a worker process: seconds from its start to the claim (the
    server's ``claimed_at``) and to the handler's start, and the CPU seconds the worker had
    used when the task was seen done (at most 50 ms after its outcome: an upper bound)."""
    key = uuid.uuid4().hex
    with TaskClient(uri, database=database) as client:
        client.publish("stamp", key)
        argv = [*script("mtask-worker", "mtask.cli.worker"), "bench.peer_app:registry"]
        argv += ["--uri", uri, "--database", database, "--log-level", "WARNING"]
        began = time.time()
        proc = subprocess.Popen(argv, env=env, cwd=ROOT, stdin=subprocess.DEVNULL)
        try:
            wait_until(lambda: _done(client, key, proc), timeout=60)
            cpu = cpu_seconds(proc.pid)
        finally:
            stop_process(proc)
        task = client.get(key)
    assert task is not None and task.runs
    return task.runs[0].claimed_at.timestamp() - began, float(task.result) - began, cpu


def _done(client: TaskClient, key: str, proc: subprocess.Popen[bytes]) -> bool:
    if proc.poll() is not None:
        raise RuntimeError(f"the worker exited with {proc.returncode} before its first claim")
    task = client.get(key)
    return task is not None and task.status == "succeeded"


async def _arq_first_job(port: int) -> tuple[float, float]:
    from arq import create_pool
    from arq.connections import RedisSettings

    redis = await create_pool(RedisSettings(port=port))
    try:
        await redis.flushall()
        job = await redis.enqueue_job("stamp")
        assert job is not None
        began = time.time()
        proc = arq_worker(port, child_env())
        try:
            started = float(await job.result(timeout=60, poll_delay=0.005))
            cpu = cpu_seconds(proc.pid)
        finally:
            stop_process(proc)
        return started - began, cpu
    finally:
        await redis.aclose()


@contextlib.contextmanager
def _arq_redis() -> Iterator[int | None]:
    """A redis-server for arq's side, or None where redis-server or arq is missing."""
    try:
        import arq  # noqa: F401
    except ImportError:
        yield None
        return
    if shutil.which("redis-server") is None:
        yield None
        return
    with redis_server() as port:
        yield port


def _spread(values: list[float]) -> str:
    ms = sorted(v * 1000 for v in values)
    return f"{statistics.median(ms):.0f} ms ({ms[0]:.0f}-{ms[-1]:.0f})"


def startup(bench: Bench) -> None:
    quick = bench.sizes.scale_large < 1_000_000  # by value (see bench.scale._quick)
    rounds = int(os.environ.get("MTASK_STARTUP_ROUNDS", "5" if quick else "15"))
    if os.environ.get("CI") == "true" and (shutil.which("redis-server") is None):
        raise RuntimeError("bench WST needs redis-server (Debian) for arq's side")
    database = bench.db()
    with TaskClient(bench.uri, database=database) as client:
        client.publish("stamp", "shown")  # what `mtask get` reads
    got: dict[str, list[float]] = {}
    load: list[float] = []
    try:
        with _arq_redis() as port:
            for r in range(rounds + 1):  # round 0 writes the caches, uncounted
                load.append(os.getloadavg()[0])
                seen = _round(bench, database, port, fresh=r % FRESH_EVERY == 1, turn=r)
                for name, value in seen.items() if r else ():
                    got.setdefault(name, []).append(value)
    finally:
        bench.drop(database)
    _record(bench, got, rounds, load)


def _sides() -> list[tuple[str, dict[str, str]]]:
    """The trees measured: this one, and the one ``MTASK_STARTUP_BEFORE`` names (another
    checkout's root, its ``mtask`` first on the children's path), as ``before_…``."""
    sides = [("", child_env())]
    before = os.environ.get("MTASK_STARTUP_BEFORE")
    if before:
        sides.append(("before_", {**child_env(), "PYTHONPATH": f"{before}{os.pathsep}{ROOT}"}))
    return sides


def _round(
    bench: Bench, database: str, port: int | None, fresh: bool, turn: int = 0
) -> dict[str, float]:
    """One round: each measure once, in the same order, for each tree, the trees in turn
    (``turn``: which goes first, so that neither is always measured first nor second);
    ``fresh``: also a worker against a new database (it makes the indexes)."""
    seen: dict[str, float] = {}
    seen["floor"], seen["floor_cpu"] = _timed([sys.executable, "-c", "pass"], child_env())
    find = [sys.executable, "-c", FIND, bench.uri, database, "shown"]
    seen["find"], seen["find_cpu"] = _timed(find, child_env())
    mtask = script("mtask", "mtask")
    where = ["--uri", bench.uri, "--database", database]
    sides = _sides()
    for side, env in sides[turn % len(sides) :] + sides[: turn % len(sides)]:
        seen[f"{side}help"], seen[f"{side}help_cpu"] = _timed([*mtask, "--help"], env)
        seen[f"{side}get"], seen[f"{side}get_cpu"] = _timed([*mtask, "get", "shown", *where], env)
        seen[f"{side}list"], seen[f"{side}list_cpu"] = _timed([*mtask, "list", *where], env)
        seen[f"{side}stats"], seen[f"{side}stats_cpu"] = _timed([*mtask, "stats", *where], env)
        claim = _first_claim(bench.uri, database, env)
        seen[f"{side}claim"], seen[f"{side}handler"], seen[f"{side}claim_cpu"] = claim
        if fresh:
            other = bench.db()
            seen[f"{side}fresh"] = _first_claim(bench.uri, other, env)[0]
            bench.drop(other)
    if port is not None:
        seen["arq"], seen["arq_cpu"] = asyncio.run(_arq_first_job(port))
    return seen


def _record(bench: Bench, got: dict[str, list[float]], rounds: int, load: list[float]) -> None:
    med = {k: statistics.median(v) for k, v in got.items()}

    def both(name: str, peer: str | None = None, says: str = "") -> str:
        """Wall-clock and CPU; beside a ``peer``, each as a ratio to the peer's too."""
        if peer is None or peer not in med:
            return f"{_spread(got[name])}, CPU {med[f'{name}_cpu'] * 1000:.0f} ms"
        cpu = med[f"{name}_cpu"] / med[f"{peer}_cpu"]
        return (
            f"{_spread(got[name])} = {med[name] / med[peer]:.2f}x {says}, "
            f"CPU {med[f'{name}_cpu'] * 1000:.0f} ms = {cpu:.2f}x"
        )

    def mtask(side: str) -> str:
        commands = "; ".join(f"mtask {c} {both(side + c, 'find', 'the floor')}" for c in CLI)
        return (
            f"worker first claim {both(f'{side}claim', 'arq', 'arq')} (its handler "
            f"{_spread(got[f'{side}handler'])}; new database {_spread(got[f'{side}fresh'])}); "
            f"mtask --help {both(f'{side}help')}; {commands}"
        )

    arq = f"arq's first job {both('arq')}" if "arq" in got else "arq not measured"
    before = f"; the tree before: {mtask('before_')}" if "before_claim" in got else ""
    floors = f"PyMongo connect and find {both('find')}; python -c pass {both('floor')}"
    figure = f"{mtask('')}; {arq}; {floors}{before}"
    met = "arq" in med and med["claim"] <= CLAIM_RATIO * med["arq"]
    met = met and all(med[c] <= CLI_RATIO * med["find"] for c in CLI)
    bench.record(
        Result(
            "WST start-up",
            figure,
            f"first claim ≤ {CLAIM_RATIO}x arq's first job; get, list, stats ≤ {CLI_RATIO}x "
            "PyMongo's connect and find (medians, the same rounds)",
            met,
            f"{rounds} rounds, each measure once a round: median (min-max) of wall-clock from "
            "the process's start, median CPU (user + system; a worker's when its first task "
            "was seen done); console scripts, bytecode cached; a stamp task due before the "
            f"worker starts; load average {min(load):.1f}-{max(load):.1f}",
            {f"{k}_s": v for k, v in med.items()},
        )
    )
