"""Bench WBH, batch handlers: one worker (concurrency 64) drains ``n`` tasks of a
single-task handler and of a batch handler (up to 64 tasks a call, 50 ms to fill), all modes
alternated over the rounds, on a mongod of the bench's own, ``async def`` and plain ``def``
(a ``def`` single-task handler runs each call on a thread; a batch one, one thread call a
batch).

Two handlers, each in both forms:
- **a cheap handler** (``sink``), what batch handlers are for: each task writes one small
  document, with ``insert_one`` a task, or ``insert_many`` a batch (the target: a batch mode
  ≥ 2x its single mode, the same round);
- **a no-op** (``noop``): the queue's own part alone. It has no target: single-task handlers'
  claims and outcomes are batched too (a claim of up to 64 keys a round trip, one update for a
  batch's successes), so a no-op batch can save only the handler's call.

Per mode: tasks per second (first claim to last success, median of the rounds), the ratio of a
batch mode to its single mode in the same round, and the worker's and mongod's CPU µs a task.
Each task is still claimed, leased and recorded on its own. A round checks that the handlers
wrote one document per task."""

from __future__ import annotations

import os
import statistics
from typing import TYPE_CHECKING, Any

from bench.support import (
    QUICK,
    Result,
    alternated,
    medians,
    runs_span,
    wait_until,
    worker_and_client,
)
from mtask.registry import BatchItem, Registry, TaskContext

if TYPE_CHECKING:
    from bench.workloads import Bench

MODES = {
    "write": "sink",
    "write batch": "sink_batch",
    "write def": "sink_def",
    "write batch def": "sink_batch_def",
    "no-op": "noop",
    "no-op batch": "noop_batch",
    "no-op def": "noop_def",
    "no-op batch def": "noop_batch_def",
}
PAIRS = {
    "write batch": "write",
    "write batch def": "write def",
    "no-op batch": "no-op",
    "no-op batch def": "no-op def",
}
TARGETED = {"write batch", "write batch def"}
"""The pairs with a target (≥ 2x): the cheap handler's."""
ROUNDS = 3


def register(registry: Registry) -> None:
    register_sinks(registry)

    @registry.task("noop_batch", batch=64, batch_timeout=0.05)
    async def noop_batch(items: list[BatchItem]) -> list[Any]:
        return [None] * len(items)

    @registry.task("noop_def")  # a plain def: each call on a thread of the worker's pool
    def noop_def(params: dict[str, Any]) -> None:
        return None

    @registry.task("noop_batch_def", batch=64, batch_timeout=0.05)
    def noop_batch_def(items: list[BatchItem]) -> list[Any]:
        return [None] * len(items)


_SINK: dict[str, Any] = {}


def _sink_async() -> Any:
    """The sink collection on the worker's own native async client (made on first use)."""
    if "async" not in _SINK:
        from pymongo import AsyncMongoClient

        uri, database = os.environ["MTASK_BENCH_SINK"].split(" ")
        _SINK["async"] = AsyncMongoClient(uri)[database]["sink"]
    return _SINK["async"]


def _sink_sync() -> Any:
    if "sync" not in _SINK:
        from pymongo import MongoClient

        uri, database = os.environ["MTASK_BENCH_SINK"].split(" ")
        _SINK["sync"] = MongoClient(uri)[database]["sink"]
    return _SINK["sync"]


def register_sinks(registry: Registry) -> None:
    @registry.task("sink")
    async def sink(params: dict[str, Any], ctx: TaskContext) -> None:
        await _sink_async().insert_one({"_id": ctx.key, "i": params.get("i")})

    @registry.task("sink_batch", batch=64, batch_timeout=0.05)
    async def sink_batch(items: list[BatchItem]) -> list[Any]:
        await _sink_async().insert_many(
            [{"_id": it.key, "i": it.params.get("i")} for it in items], ordered=False
        )
        return [None] * len(items)

    @registry.task("sink_def")
    def sink_def(params: dict[str, Any], ctx: TaskContext) -> None:
        _sink_sync().insert_one({"_id": ctx.key, "i": params.get("i")})

    @registry.task("sink_batch_def", batch=64, batch_timeout=0.05)
    def sink_batch_def(items: list[BatchItem]) -> list[Any]:
        _sink_sync().insert_many(
            [{"_id": it.key, "i": it.params.get("i")} for it in items], ordered=False
        )
        return [None] * len(items)


def _one(uri: str, mongod_pid: int, mode: str, n: int, round_: int) -> dict[str, float]:
    from bench.cpu import tree_cpu_seconds
    from bench.scale import _cpu_s

    name = MODES[mode]
    database = f"wbh_{name}_{round_}"
    env = {"MTASK_BENCH_SINK": f"{uri} {database}"}
    with worker_and_client(uri, database, "--concurrency", "64", env=env) as (proc, client):
        w0, m0 = tree_cpu_seconds(proc.pid), _cpu_s(mongod_pid)
        client.publish_many(
            {"name": name, "key": f"t{i:06d}", "params": {"i": i}} for i in range(n)
        )
        done = {"name": name, "status": "succeeded"}
        wait_until(lambda: client.collection.count_documents(done) == n, timeout=600)
        w1, m1 = tree_cpu_seconds(proc.pid), _cpu_s(mongod_pid)
        written = client.collection.database["sink"].count_documents({})
        if written != (n if name.startswith("sink") else 0):
            raise RuntimeError(f"WBH {mode}: {written} documents written for {n} tasks")
        seconds = max(runs_span(client.collection), 1e-3)
        return {
            "rate": n / seconds,
            "worker_us": (w1 - w0) * 1e6 / n,
            "mongod_us": (m1 - m0) * 1e6 / n,
        }


def batch_handlers(bench: Bench) -> None:
    from bench.scale import _own_mongod

    quick = bench.sizes is QUICK
    n, rounds = (2000, 2) if quick else (10000, ROUNDS)
    with _own_mongod() as (uri, pid, _port):
        figures = alternated(list(MODES), rounds, lambda mode, r: _one(uri, pid, mode, n, r))
    median = medians(figures)

    ratios = {
        mode: statistics.median(
            b["rate"] / s["rate"] for b, s in zip(figures[mode], figures[single], strict=True)
        )
        for mode, single in PAIRS.items()
    }
    for mode in MODES:
        ratio = ratios.get(mode)
        targeted = mode in TARGETED
        writes = MODES[mode].startswith("sink")
        what = "tasks writing one document each" if writes else "no-op tasks"
        bench.record(
            Result(
                f"WBH {mode}",
                f"{median(mode, 'rate'):,.0f} tasks/s"
                + ("" if ratio is None else f" = {ratio:.2f}x {PAIRS[mode]}"),
                f"≥ 2x {PAIRS[mode]}" if targeted else "(no target)",
                ratio >= 2.0 if targeted and ratio is not None else None,
                f"{n:,} {what}, {rounds} rounds alternated; worker "
                f"{median(mode, 'worker_us'):.0f} µs, mongod {median(mode, 'mongod_us'):.0f} µs "
                "a task",
                {
                    "per_s": median(mode, "rate"),
                    "worker_us": median(mode, "worker_us"),
                    "mongod_us": median(mode, "mongod_us"),
                    **({} if ratio is None else {"ratio": ratio}),
                },
            )
        )
