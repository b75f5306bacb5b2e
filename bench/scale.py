"""Benchmarks of a large collection and of many workers, run by ``python -m bench``:

* ``ST`` stats at scale: ``stats()`` at 10,000 and at 1,000,000 tasks (1,000 open, the rest
  finished), the open-only counts (``stats(OPEN)``), and exact counts for comparison.
* ``W9`` many workers: 1, 8, 32 and 64 worker processes (concurrency 4 each; ``--quick``: 1
  and 4) on a mongod of their own (so that its CPU is theirs alone), idle and under a steady
  publish load: claim attempts per task, mongod CPU per task, change-stream cost per worker
  (mongod CPU and getMores while idle, server-side streams), publish → handler start p50; each
  size in both stream modes (``--stream own`` then ``shared``; ``MTASK_W9_STREAMS``), with
  ``MTASK_W9_SIZES``, ``MTASK_W9_RATE`` and ``MTASK_W9_SECONDS`` for by-hand runs.
* ``W9H`` many hosts: W9 with every worker in a network namespace of its own (below);
  ``MTASK_W9H_SIZES``, ``MTASK_W9_STREAMS``, ``MTASK_W9_SECONDS`` (tasks = 100/s x seconds) and
  ``MTASK_W9H_PASSES`` (each figure the median of that many passes) and
  ``MTASK_W9_IDLE_SECONDS`` (the idle window, 60 s) for by-hand runs.
* ``W7X`` memory under a backlog: 4 worker processes at concurrency 32 draining 100,000 tasks
  published before they start, and published while they run, in each stream mode; the peak
  RSS of the largest.

Each function takes the ``Bench`` and records ``Result``\\ s; ``python -m bench.scale --worker
URI DATABASE CONCURRENCY [own|shared]`` is the W9 worker process (it prints its claim counters).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pymongo import MongoClient

from bench.support import LOOP, ROOT, Result, peak_rss_kb, spawn_worker, stop_process
from mtask import store
from mtask.client import TaskClient
from mtask.models import NewTask
from mtask.statemachine import OPEN

if TYPE_CHECKING:
    from bench.workloads import Bench

Doc = dict[str, Any]
CLK_TCK = os.sysconf("SC_CLK_TCK")


def _quick(bench: Bench) -> bool:
    # by value, so that it holds however the runner was started (as ``__main__`` or not)
    return bench.sizes.scale_large < 1_000_000


# -- ST: stats at scale ---------------------------------------------------------------------------


def _fill(bench: Bench, total: int) -> str:
    """A database with ``total`` tasks of five names: 1,000 pending, the rest finished
    (succeeded, failed, cancelled), inserted raw in the shape ``store.new_document`` gives."""
    name = bench.db()
    coll = bench.mongo[name]["tasks"]
    with TaskClient(bench.uri, database=name) as client:
        now = client.now()
        base = {
            k: v for k, v in store.new_document(NewTask.build("n", "x"), now).items() if k != "_id"
        }
        statuses = ["succeeded"] * 8 + ["failed", "cancelled"]
        batch: list[Doc] = []
        for i in range(total - 1000):
            status = statuses[i % 10]
            batch.append(
                {
                    **base,
                    "_id": f"f{i}",
                    "name": f"n{i % 5}",
                    "status": status,
                    "next_claim_at": None,
                    "finished_at": now,
                }
            )
            if len(batch) == 10_000:
                coll.insert_many(batch, ordered=False)
                batch = []
        if batch:
            coll.insert_many(batch, ordered=False)
        client.publish_many({"name": f"n{i % 5}", "key": f"p{i}"} for i in range(1000))
    return name


def _stats_p50(bench: Bench, name: str, mode: str, rounds: int = 15) -> float:
    """p50 ms of ``stats()`` as the dashboard asks (``default``), exactly (``exact``), or of
    the open statuses only (``open``)."""

    def op() -> Any:
        if mode == "open":
            return store.stats(OPEN)
        return store.stats(exact=mode == "exact")

    with TaskClient(bench.uri, database=name) as client:
        client.stats()  # warm
        times = []
        for _ in range(rounds if mode != "exact" else 3):
            began = time.perf_counter()
            client._run(op())
            times.append((time.perf_counter() - began) * 1000)
    return statistics.median(times)


def stats_at_scale(bench: Bench) -> None:
    small, large = (2_000, 40_000) if _quick(bench) else (10_000, 1_000_000)
    figures: dict[int, dict[str, float]] = {}
    for total in (small, large):
        name = _fill(bench, total)
        figures[total] = {m: _stats_p50(bench, name, m) for m in ("default", "open", "exact")}
        bench.drop(name)
    a, b = figures[small], figures[large]
    bench.record(
        _result(
            "ST stats at scale",
            f"stats() p50 {a['default']:.1f} ms at {small:,} vs {b['default']:.1f} ms at "
            f"{large:,} tasks (ratio {b['default'] / a['default']:.1f}); open statuses only: "
            f"{a['open']:.1f} vs {b['open']:.1f} ms; every count exact (exact=True): "
            f"{a['exact']:.1f} vs {b['exact']:.1f} ms",
            "≤ 2x and < 20 ms at the large size",
            b["default"] <= 2 * a["default"] and b["default"] < 20,
            "1,000 pending, the rest finished, 5 names; open tasks exact, finished ones exact "
            "up to 1,000 per name and status and '1,000+' above (docs/scale.md, Counts)",
            {
                **{f"small_{k}_ms": v for k, v in a.items()},
                **{f"large_{k}_ms": v for k, v in b.items()},
            },
        )
    )


def _result(*args: Any) -> Result:
    return Result(*args)


# -- W9: many workers -----------------------------------------------------------------------------


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def _getmores(client: MongoClient[Doc]) -> int:
    status = client.admin.command("serverStatus")
    return int(status["metrics"]["commands"]["getMore"]["total"])


def _streams(client: MongoClient[Doc], database: str, collection: str | None = None) -> int:
    """The change-stream cursors open on ``database`` (idle or in a getMore), or on one of its
    collections."""
    ns: Any = {"$regex": f"^{database}\\."} if collection is None else f"{database}.{collection}"
    ops = client.admin.aggregate(
        [
            {"$currentOp": {"idleCursors": True, "allUsers": True}},
            {
                "$match": {
                    "ns": ns,
                    "$or": [
                        {"cursor.originatingCommand.pipeline.0.$changeStream": {"$exists": True}},
                        {"command.pipeline.0.$changeStream": {"$exists": True}},
                    ],
                }
            },
        ]
    )
    return len({op.get("cursor", {}).get("cursorId", op.get("opid")) for op in ops})


def _ops(client: MongoClient[Doc]) -> dict[str, int]:
    """The server's operation counters (serverStatus ``opcounters``)."""
    counters = client.admin.command("serverStatus")["opcounters"]
    return {
        kind: int(counters[kind]) for kind in ("insert", "query", "update", "getmore", "command")
    }


def _commands(client: MongoClient[Doc]) -> dict[str, int]:
    """How many of each command the server has run (serverStatus ``metrics.commands``)."""
    commands = client.admin.command("serverStatus")["metrics"]["commands"]
    return {
        name: int(counts["total"])
        for name, counts in commands.items()
        if isinstance(counts, dict) and "total" in counts
    }


def _idle_commands(row: Doc) -> str:
    """The commands an idle cluster sent most, a second each (``idle_cmd_*``)."""
    rates = {k[len("idle_cmd_") : -len("_per_s")]: v for k, v in row.items() if "idle_cmd_" in k}
    top = sorted(rates.items(), key=lambda kv: -kv[1])[:6]
    return ", ".join(f"{name} {rate:.1f}" for name, rate in top)


def _checkpoints(client: MongoClient[Doc]) -> int:
    """The checkpoints WiredTiger has taken (one a minute: one in a window costs it CPU)."""
    status = client.admin.command("serverStatus")
    return int(status["wiredTiger"]["transaction"]["transaction checkpoints"])


def socket_uri(port: int) -> str:
    """mongod's Unix socket as a URI: a Unix socket crosses network namespaces (an abstract
    one does not), so a worker in a namespace of its own reaches mongod through it."""
    return f"mongodb://%2Ftmp%2Fmongodb-{port}.sock/?directConnection=true"


def _spawn(
    uri: str, database: str, concurrency: int, stream: str, host: bool = False
) -> subprocess.Popen[str]:
    """One W9 worker; with ``host``, in a network namespace of its own (``unshare --net``): a
    host of its own, for the per-host relay too."""
    return subprocess.Popen(
        [
            *(["unshare", "--net"] if host else []),
            *(sys.executable, "-m", "bench.scale", "--worker", uri, database),
            *(str(concurrency), stream),
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )


def _stop_all(procs: list[subprocess.Popen[str]]) -> list[Doc]:
    for proc in procs:
        proc.send_signal(signal.SIGTERM)
    out = []
    for proc in procs:
        try:
            text, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            text, _ = proc.communicate()
        lines = [line for line in text.splitlines() if line.startswith("{")]
        out.append(json.loads(lines[-1]) if lines else {})
    return out


def _wait(check: Any, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError("benchmark condition not reached in time")
        time.sleep(0.1)


def _one_size(
    uri: str,
    mongod_pid: int,
    workers: int,
    rate: int,
    seconds: float,
    stream: str,
    worker_uri: str | None = None,
    chunk: int | None = None,
    idle_seconds: float | None = None,
) -> Doc:
    """One W9 size; with ``worker_uri`` (mongod's socket), each worker is a host of its own."""
    mongo: MongoClient[Doc] = MongoClient(uri, w="majority")
    database = f"w9_{workers}_{stream}_{os.getpid()}"
    mongo.drop_database(database)
    with TaskClient(uri, database=database) as client:
        procs = [
            _spawn(worker_uri or uri, database, 4, stream, host=worker_uri is not None)
            for _ in range(workers)
        ]
        try:
            _wait(lambda: len(client.workers()) >= workers)
            if stream == "shared" and workers > 1:  # each handed its work by the relay
                _wait(lambda: _dispatched(client) >= workers)
            time.sleep(2.0)  # a task open while they start is raced for (startup, not steady)
            client.publish("stamp", "warm", {"t": time.time()})
            _wait(lambda: client.stats().get("stamp", {}).get("succeeded", 0) == 1)
            time.sleep(2.0)  # every worker's stream open, first scans done
            # idle
            cpu0, gm0, t0 = _cpu_s(mongod_pid), _getmores(mongo), time.monotonic()
            idle_ops0, checkpoints0 = _ops(mongo), _checkpoints(mongo)
            commands0 = _commands(mongo)
            time.sleep(idle_seconds or seconds)
            idle_ops = {k: v - idle_ops0[k] for k, v in _ops(mongo).items()}
            checkpoints = _checkpoints(mongo) - checkpoints0
            idle_commands = {
                name: count - commands0.get(name, 0)
                for name, count in _commands(mongo).items()
                if count > commands0.get(name, 0)
            }
            idle_cpu = _cpu_s(mongod_pid) - cpu0
            idle_gm = _getmores(mongo) - gm0
            idle_s = time.monotonic() - t0
            streams = _streams(mongo, database)
            load0 = os.getloadavg()[0]
            # a steady publish load
            n = int(rate * seconds)
            cpu0, gm0, ops0 = _cpu_s(mongod_pid), _getmores(mongo), _ops(mongo)
            began = time.monotonic()
            chunk = chunk or max(1, rate // 20)
            # created_at is the publisher's estimate of the server's clock: one calibrated now,
            # on a quiet host (``client`` calibrated while the workers started, when a round
            # trip, and so its estimate's error, could be long)
            with TaskClient(uri, database=database) as publisher:
                publisher.now()
                for start in range(0, n, chunk):
                    due = began + start / rate
                    pause = due - time.monotonic()
                    if pause > 0:
                        time.sleep(pause)
                    now = time.time()
                    publisher.publish_many(
                        {"name": "stamp", "key": f"k{i}", "params": {"t": now}}
                        for i in range(start, min(n, start + chunk))
                    )
            _wait(lambda: client.stats(exact=True).get("stamp", {}).get("succeeded", 0) == n + 1)
            load_cpu = _cpu_s(mongod_pid) - cpu0
            load_gm = _getmores(mongo) - gm0
            load_ops = {k: v - ops0[k] for k, v in _ops(mongo).items()}
            docs = list(
                client.collection.find(
                    {"_id": {"$ne": "warm"}},
                    {
                        "result": 1,
                        "params.t": 1,
                        "created_at": 1,
                        "finished_at": 1,
                        "runs.worker_id": 1,
                        "runs.claimed_at": 1,
                    },
                )
            )
            # mongod runs on this host: its clock is time.time()'s, so a run's claimed_at (the
            # claimer's estimate of the server's clock) against its handler's start shows how
            # far off that estimate is (less the claim's reply → handler start, under 1 ms)
            ahead = [
                (doc["runs"][0]["claimed_at"].timestamp() - doc["result"]) * 1000
                for doc in docs
                if doc.get("runs") and isinstance(doc.get("result"), float)
            ]
            ran = collections.Counter(
                run.get("worker_id") for doc in docs for run in doc.get("runs") or ()
            )
            lags = [(doc["result"] - doc["params"]["t"]) * 1000 for doc in docs]
            waits = [
                (doc["finished_at"] - doc["created_at"]).total_seconds() * 1000 for doc in docs
            ]
        finally:
            counters = _stop_all(procs)
    mongo.drop_database(database)
    mongo.close()
    attempts = sum(c.get("claim_attempts", 0) for c in counters)
    claimed = sum(c.get("claimed", 0) for c in counters)
    return {
        "workers": workers,
        "shared": float(stream == "shared"),
        "streams": streams,
        "load_avg": max(load0, os.getloadavg()[0]),
        "attempts_per_task": attempts / max(1, claimed),
        "cpu_ms_per_task": load_cpu * 1000 / n,
        "idle_cpu_pct_per_worker": idle_cpu / idle_s * 100 / workers,
        "idle_getmores_per_worker_s": idle_gm / idle_s / workers,
        "getmores_per_task": load_gm / n,
        "start_p50_ms": statistics.median(lags),
        "finished_p50_ms": statistics.median(waits),
        **{f"{kind}_per_task": count / n for kind, count in load_ops.items()},
        "idle_ops_per_s": sum(idle_ops.values()) / idle_s,
        **{f"idle_{kind}_per_s": count / idle_s for kind, count in idle_ops.items()},
        "idle_cpu_pct": idle_cpu / idle_s * 100,
        "idle_checkpoints": float(checkpoints),
        **{f"idle_cmd_{name}_per_s": n / idle_s for name, n in idle_commands.items()},
        "tasks": n,
        "busiest_share": max(ran.values(), default=0) / max(1, sum(ran.values())),
        "workers_used": float(len(ran)),
        "claimed_at_ahead_p50_ms": statistics.median(ahead) if ahead else 0.0,
        "rescans_per_worker": sum(c.get("rescans", 0) for c in counters) / workers,
        "dropped": sum(c.get("dropped", 0) for c in counters),
        "left_relay": sum(c.get("left", 0) for c in counters),
        "took_over": sum(c.get("took_over", 0) for c in counters),
        "subscriptions": sum(c.get("connections", 0) for c in counters),
        "returned": sum(c.get("returned", 0) for c in counters),
        **{
            f"said_{kind}": sum(c.get(kind, 0) for c in counters)
            for kind in ("claimed", "held", "done", "missed", "gone")
        },
    }


@contextlib.contextmanager
def _own_mongod() -> Iterator[tuple[str, int, int]]:
    """A mongod of the bench's own, so that the CPU read from ``/proc`` is its workers' alone:
    its URI, pid and port (its Unix socket is ``/tmp/mongodb-PORT.sock``)."""
    from mtask.embedded import EmbeddedMongo

    with tempfile.TemporaryDirectory(prefix="mtask-w9-") as tmp:
        mongod = EmbeddedMongo(tmp, cache_size_gb=0.5)
        uri = mongod.start()
        try:
            mongo: MongoClient[Doc] = MongoClient(uri)
            pid = int(mongo.admin.command("serverStatus")["pid"])
            mongo.close()
            yield uri, pid, int(uri.split(":")[2].split("/")[0])
        finally:
            mongod.stop()


def many_workers(bench: Bench) -> None:
    """W9 in both stream modes, alternating (own, shared) at each size in one run."""
    sizes, rate, seconds = ([1, 4], 200, 3.0) if _quick(bench) else ([1, 8, 32, 64], 1000, 10.0)
    if os.environ.get("MTASK_W9_SIZES"):  # a by-hand run on a small machine
        sizes = [int(n) for n in os.environ["MTASK_W9_SIZES"].split(",")]
    rate = int(os.environ.get("MTASK_W9_RATE", rate))
    seconds = float(os.environ.get("MTASK_W9_SECONDS", seconds))
    modes = os.environ.get("MTASK_W9_STREAMS", "own,shared").split(",")
    with _own_mongod() as (uri, pid, _):
        rows = [_one_size(uri, pid, n, rate, seconds, mode) for n in sizes for mode in modes]
    for row in rows:
        mode = "shared" if row["shared"] else "own"
        base = next(r for r in rows if r["shared"] == row["shared"])["cpu_ms_per_task"]
        ratio = row["cpu_ms_per_task"] / base
        bench.record(
            _result(
                f"W9 many workers x{row['workers']} ({mode} streams)",
                f"{row['attempts_per_task']:.2f} claim attempts/task; mongod "
                f"{row['cpu_ms_per_task']:.3f} ms CPU/task ({ratio:.2f}x of 1 worker); "
                f"{row['streams']} change streams; idle: "
                f"{row['idle_cpu_pct_per_worker']:.2f} % CPU and "
                f"{row['idle_getmores_per_worker_s']:.2f} getMore/s per worker; "
                f"{row['getmores_per_task']:.2f} getMore/task; "
                f"publish→start p50 {row['start_p50_ms']:.1f} ms",
                "≤ 1.5 attempts/task; CPU/task ≤ 1.5x of 1 worker",
                row["attempts_per_task"] <= 1.5 and ratio <= 1.5,
                f"{row['workers']} processes x concurrency 4, --stream {mode}, own mongod, "
                f"{row['tasks']:,} tasks at {rate}/s, load average up to {row['load_avg']:.0f}",
                {k: float(v) for k, v in row.items()},
            )
        )


def many_hosts(bench: Bench) -> None:
    """W9H: W9 with every worker a host of its own (its own network namespace, reaching mongod
    through its Unix socket), as with one worker per pod or VM: only MongoDB is shared. Both
    stream modes at each size, in one run."""
    if shutil.which("unshare") is None:
        raise RuntimeError("W9H needs unshare (util-linux) to give each worker a host of its own")
    sizes, rate, seconds = ([1, 4], 100, 3.0) if _quick(bench) else ([1, 8, 32, 64, 128], 100, 3.0)
    # idle: heartbeats, lease looks and tails come seconds apart, the bounding reads of the
    # limits, paused names and schedules every 30 and 60 s: a minute holds each as often as
    # it comes (12 s windows read 3.6 to 6.3 % at 64 hosts, by whether a read fell in them)
    idle = seconds if _quick(bench) else float(os.environ.get("MTASK_W9_IDLE_SECONDS", "60"))
    if os.environ.get("MTASK_W9H_SIZES"):
        sizes = [int(n) for n in os.environ["MTASK_W9H_SIZES"].split(",")]
    seconds = float(os.environ.get("MTASK_W9_SECONDS", seconds))  # tasks: rate x seconds
    modes = os.environ.get("MTASK_W9_STREAMS", "shared,own").split(",")
    passes = max(1, int(os.environ.get("MTASK_W9H_PASSES", "1")))
    with _own_mongod() as (uri, pid, port):
        runs = [
            [
                _one_size(
                    uri, pid, n, rate, seconds, mode, socket_uri(port), chunk=1, idle_seconds=idle
                )
                for n in sizes
                for mode in modes
            ]
            for _ in range(passes)
        ]
    # each figure the median of its passes: one pass swings by a third on a small machine
    rows = [
        (mode, {k: statistics.median(run[i].get(k, 0.0) for run in runs) for k in runs[0][i]})
        for i, mode in enumerate(m for _ in sizes for m in modes)
    ]
    for i, (mode, row) in enumerate(rows):
        first = next(j for j, (m, _) in enumerate(rows) if m == mode)
        one = rows[first][1]
        cpu = row["cpu_ms_per_task"] / one["cpu_ms_per_task"]
        # the same ratio within each pass (one host's figure drifts from pass to pass)
        by_pass = [run[i]["cpu_ms_per_task"] / run[first]["cpu_ms_per_task"] for run in runs]
        wait = row["finished_p50_ms"] / one["finished_p50_ms"]
        # the same wait on one clock: publish → handler start, both read by this host's
        # time.time() (created_at and finished_at are two processes' estimates of the server's
        # clock, each stored to the millisecond)
        start = row["start_p50_ms"] / one["start_p50_ms"]
        ops = " ".join(
            f"{kind} {row[f'{kind}_per_task']:.2f}"
            for kind in ("insert", "query", "update", "getmore", "command")
        )
        bench.record(
            _result(
                f"W9H many hosts x{row['workers']:.0f} ({mode} streams)",
                f"mongod {row['cpu_ms_per_task']:.2f} ms CPU/task ({cpu:.2f}x of "
                + ("1 host" if one["workers"] == 1 else f"{one['workers']:.0f} hosts")
                + (
                    f"; within each pass {', '.join(f'{r:.2f}' for r in by_pass)}x"
                    if passes > 1
                    else ""
                )
                + "); "
                f"{row['attempts_per_task']:.2f} claim attempts/task; created→finished p50 "
                f"{row['finished_p50_ms']:.1f} ms ({wait:.2f}x), publish→start "
                f"{row['start_p50_ms']:.1f} ms ({start:.2f}x), claimed_at - handler start "
                f"{row['claimed_at_ahead_p50_ms']:+.1f} ms; ops/task: {ops}; idle: "
                f"{row['idle_cpu_pct']:.1f} % of a core, {row['idle_ops_per_s']:.0f} ops/s ("
                + " ".join(
                    f"{kind} {row[f'idle_{kind}_per_s']:.1f}"
                    for kind in ("insert", "query", "update", "getmore", "command")
                )
                + f"; {row['idle_checkpoints']:.0f} checkpoints; by command: "
                + _idle_commands(row)
                + "); "
                f"relay left {row['left_relay']:.0f}x, taken over by its standby "
                f"{row['took_over']:.0f}x, keys given back {row['returned']:.0f}, "
                f"missed {row['said_missed']:.0f}, gone {row['said_gone']:.0f}, "
                f"held {row['said_held']:.0f}; runs on {row['workers_used']:.0f} workers, the "
                f"busiest {row['busiest_share']:.0%}; {row['subscriptions']:.0f} subscriptions, "
                f"{row['dropped']:.0f} dropped",
                "CPU/task ≤ 1.5x of 1 host; ≤ 1.1 attempts/task; p50 ≤ 2x; idle ≤ 5 % at 64",
                cpu <= 1.5
                and row["attempts_per_task"] <= 1.1
                and wait <= 2
                and (row["workers"] < 64 or row["idle_cpu_pct"] <= 5),
                f"{row['workers']:.0f} hosts (network namespaces) x 1 worker at concurrency 4, "
                f"--stream {mode}, own mongod over its Unix socket, {row['tasks']:,.0f} no-op "
                f"tasks at {rate}/s, load average up to {row['load_avg']:.0f}"
                + (f"; each figure the median of {passes} passes" if passes > 1 else ""),
                {k: float(v) for k, v in row.items()}
                | {f"cpu_ratio_pass_{p}": r for p, r in enumerate(by_pass, 1)},
            )
        )


def worker_process(uri: str, database: str, concurrency: int, stream: str = "shared") -> int:
    """One W9 worker: runs until SIGTERM, then prints its claim counters as JSON."""
    from bench.app import registry
    from mtask.cli.worker import loop_factory
    from mtask.worker import Worker

    worker = Worker(
        registry,
        uri=uri,
        database=database,
        names=["stamp"],
        concurrency=concurrency,
        stream="own" if stream == "own" else "shared",
    )

    async def main() -> None:
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, worker.stop)
        await worker.run()

    with asyncio.Runner(loop_factory=loop_factory(LOOP)[1]) as runner:  # as mtask-worker's
        runner.run(main())
    stats = worker.stats
    with contextlib.suppress(BrokenPipeError):  # the bench gave up on us
        print(
            json.dumps(
                {
                    "claim_attempts": stats.claim_attempts,
                    "claimed": stats.claimed,
                    "rescans": worker.parts.finding.finder.scanner.rescans,
                    **_shared_counters(worker),
                }
            ),
            flush=True,
        )
    return 0


def _dispatched(client: TaskClient) -> int:
    """Workers whose heartbeat says the relay hands them their tasks."""
    return sum((w.get("stream") or {}).get("mode") == "dispatched" for w in client.workers())


def _shared_counters(worker: Any) -> dict[str, int]:
    """What a worker's side of the shared stream counted (none with an own stream)."""
    shared = worker.parts.finding.shared
    if shared is None:
        return {}
    relay = shared.relay  # (the one this process held last: read after the worker stopped)
    return {
        "left": shared.left_silent,
        "took_over": shared.holder.took_over,
        "connections": shared.connections,
        "dropped": 0 if relay is None else relay.dropped,
        "returned": 0 if relay is None else relay.dispatcher.returned,
        **({} if relay is None else relay.dispatcher.said),
    }


# -- W7X: memory under a large backlog ------------------------------------------------------------


def backlog_memory(bench: Bench) -> None:
    """W7X in two shapes, each stream mode: the backlog published before the workers start,
    and published while they run (every insert is an event for them)."""
    backlog = 10_000 if _quick(bench) else 100_000
    rows = [
        (mode, during, _backlog_peak(bench, backlog, mode, during))
        for during in (False, True)
        for mode in ("shared", "own")
    ]
    for mode, during, peak in rows:
        shape = "published while they run" if during else "published before they start"
        bench.record(
            _result(
                f"W7X memory, backlog {'during' if during else 'before'} ({mode} streams)",
                f"{peak:.0f} MB peak RSS (largest of 4 workers)",
                "≤ 150 MB",
                peak <= 150,
                f"{backlog:,} tasks {shape}; 4 workers at concurrency 32, --stream {mode}",
                {"peak_mb": peak},
            )
        )


def _backlog_peak(bench: Bench, backlog: int, mode: str, during: bool) -> float:
    name = bench.db()
    with TaskClient(bench.uri, database=name) as client:

        def publish() -> None:
            for start in range(0, backlog, 10_000):
                client.publish_many(
                    {"name": "noop", "key": f"k{i}"}
                    for i in range(start, min(backlog, start + 10_000))
                )

        if not during:
            publish()
        procs = [
            spawn_worker(bench.uri, name, "--concurrency", "32", "--stream", mode) for _ in range(4)
        ]
        peaks = [0] * len(procs)

        def sample() -> None:
            for i, proc in enumerate(procs):
                peaks[i] = max(peaks[i], peak_rss_kb(proc.pid))

        try:
            _wait(lambda: len(client.workers()) >= len(procs))
            if during:
                publish()

            def drained() -> bool:
                sample()
                return client.stats(exact=True).get("noop", {}).get("succeeded", 0) == backlog

            _wait(drained)
        finally:
            sample()
            for proc in procs:
                stop_process(proc)
    bench.drop(name)
    return max(peaks) / 1024


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        sys.exit(worker_process(sys.argv[2], sys.argv[3], int(sys.argv[4]), *sys.argv[5:6]))
    sys.exit("usage: python -m bench.scale --worker URI DATABASE CONCURRENCY [own|shared]")
