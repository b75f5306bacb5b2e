"""Bench WO, live output: what progress, log lines and chunks cost per second of
handler time.

Four handlers run at once in one worker (concurrency 4) for ``seconds`` each, on a mongod of
the bench's own (the CPU read from ``/proc`` is this workload's alone), once per mode:

- ``quiet``: the handler only waits (the baseline every other mode is compared with);
- ``progress``: ``ctx.progress`` 10,000 times a second (coalesced to the writer's interval);
- ``logs``: 100 ``ctx.log.info`` lines a second;
- ``chunks``: 100 ``ctx.emit`` chunks of 64 bytes a second;
- ``chunks1k``: 1,000 chunks a second.

Per second of handler time, above ``quiet``: the worker's CPU, mongod's CPU, the server's
write operations (``opcounters`` insert, per document, + update + command), its committed
transactions, and the bytes stored in the output collection.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from pymongo import MongoClient

from bench.support import QUICK, Result, wait_until, worker_and_client
from mtask.registry import Registry, TaskContext

if TYPE_CHECKING:
    from bench.workloads import Bench

RATES = {"quiet": 0, "progress": 10_000, "logs": 100, "chunks": 100, "chunks1k": 1_000}
TICK = 0.01
RUNS = 4
CHUNK = "x" * 64


async def talk(params: dict[str, Any], ctx: TaskContext) -> int:
    """Says ``rate`` things a second of ``mode`` for ``seconds``, in 10 ms ticks."""
    mode, rate, seconds = params["mode"], params["rate"], params["seconds"]
    per_tick, said = rate * TICK, 0.0
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    while loop.time() < end:
        said += per_tick
        while said >= 1:
            said -= 1
            if mode == "progress":
                ctx.progress(min(1.0, (seconds - (end - loop.time())) / seconds), "working")
            elif mode == "logs":
                ctx.log.info("a line", n=int(said))
            else:
                ctx.emit(CHUNK)
        await asyncio.sleep(TICK)
    return 0


def register(registry: Registry) -> None:
    registry.task("talk")(talk)


def _writes(mongo: MongoClient[dict[str, Any]]) -> tuple[int, int]:
    """The server's write operations (``opcounters`` insert, counted per document, + update +
    command) and its committed transactions."""
    status = mongo.admin.command("serverStatus")
    counters = status["opcounters"]
    ops = int(counters["insert"]) + int(counters["update"]) + int(counters["command"])
    return ops, int(status["transactions"]["totalCommitted"])


def _one(uri: str, mongod_pid: int, mode: str, seconds: float) -> dict[str, float]:
    from bench.cpu import tree_cpu_seconds
    from bench.scale import _cpu_s

    database = f"wo_{mode}"
    with worker_and_client(uri, database, "--concurrency", str(RUNS)) as (proc, client):
        mongo = client.mongo
        w0, m0, o0 = tree_cpu_seconds(proc.pid), _cpu_s(mongod_pid), _writes(mongo)
        began = time.monotonic()
        for i in range(RUNS):
            params = {"mode": mode, "rate": RATES[mode], "seconds": seconds}
            client.publish("talk", f"{mode}-{i}", params)
        wait_until(lambda: client.stats().get("talk", {}).get("succeeded", 0) == RUNS)
        wall = time.monotonic() - began
        w1, m1, o1 = tree_cpu_seconds(proc.pid), _cpu_s(mongod_pid), _writes(mongo)
        stored = client.db.command("collStats", "tasks.output") if mode != "quiet" else {}
        handler_s = RUNS * seconds
        return {
            "worker_ms": (w1 - w0) * 1000 / handler_s,
            "mongod_ms": (m1 - m0) * 1000 / handler_s,
            "writes": (o1[0] - o0[0]) / handler_s,
            "commits": (o1[1] - o0[1]) / handler_s,
            "bytes": float(stored.get("size", 0)) / handler_s,
            "wall": wall,
        }


def live_output(bench: Bench) -> None:
    from bench.scale import _own_mongod

    seconds = 2.0 if bench.sizes is QUICK else 5.0
    with _own_mongod() as (uri, pid, _port):
        figures = {mode: _one(uri, pid, mode, seconds) for mode in RATES}
    quiet = figures["quiet"]
    rows = []
    for mode in RATES:
        if mode == "quiet":
            continue
        f = figures[mode]
        rows.append(
            f"{mode} ({RATES[mode]:,}/s): worker +{f['worker_ms'] - quiet['worker_ms']:.1f} ms/s, "
            f"mongod +{f['mongod_ms'] - quiet['mongod_ms']:.1f} ms/s, "
            f"+{f['writes'] - quiet['writes']:.1f} server ops/s "
            f"({f['commits'] - quiet['commits']:.1f} transactions/s), "
            f"{f['bytes'] / 1024:.1f} KiB/s stored"
        )
    bench.record(
        Result(
            "WO live output",
            "; ".join(rows),
            "measured (a handler that says nothing pays nothing)",
            None,
            f"per second of handler time above a quiet handler (worker {quiet['worker_ms']:.1f}"
            f" ms/s, mongod {quiet['mongod_ms']:.1f} ms/s, {quiet['writes']:.1f} writes/s); "
            f"{RUNS} runs at once x {seconds:g} s each, one worker, own mongod",
            {f"{m}_{k}": v for m, f in figures.items() for k, v in f.items()},
        )
    )
