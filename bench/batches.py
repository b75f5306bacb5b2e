"""Bench WBH, batch handlers (issue 62): one worker (concurrency 64) drains ``n`` cheap tasks
of a single-task handler (``noop``) and of a batch handler (``noop_batch``: up to 64 tasks a
call, 50 ms to fill), the modes alternated over the rounds, on a mongod of the bench's own.
The same for plain ``def`` handlers (``noop_def``: each call on a thread;
``noop_batch_def``: one thread call per batch). Per mode: tasks per second (first claim to last
success, median of the rounds), the ratio of a batch mode to its single mode in the same round
(target ≥ 2), and the worker's and mongod's CPU µs a task. Each task is still claimed, leased
and recorded on its own: the batch saves the worker's per-call work (a run's task and span and
outcome remain)."""

from __future__ import annotations

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
from mtask.batches import BatchItem
from mtask.registry import Registry

if TYPE_CHECKING:
    from bench.workloads import Bench

MODES = {
    "single": "noop",
    "batch": "noop_batch",
    "single def": "noop_def",
    "batch def": "noop_batch_def",
}
PAIRS = {"batch": "single", "batch def": "single def"}
ROUNDS = 3


def register(registry: Registry) -> None:
    @registry.task("noop_batch", batch=64, batch_timeout=0.05)
    async def noop_batch(items: list[BatchItem]) -> list[Any]:
        return [None] * len(items)

    @registry.task("noop_def")  # a plain def: each call on a thread of the worker's pool
    def noop_def(params: dict[str, Any]) -> None:
        return None

    @registry.task("noop_batch_def", batch=64, batch_timeout=0.05)
    def noop_batch_def(items: list[BatchItem]) -> list[Any]:
        return [None] * len(items)


def _one(uri: str, mongod_pid: int, mode: str, n: int, round_: int) -> dict[str, float]:
    from bench.cpu import tree_cpu_seconds
    from bench.scale import _cpu_s

    name = MODES[mode]
    database = f"wbh_{name}_{round_}"
    with worker_and_client(uri, database, "--concurrency", "64") as (proc, client):
        w0, m0 = tree_cpu_seconds(proc.pid), _cpu_s(mongod_pid)
        client.publish_many({"name": name, "key": f"t{i:06d}"} for i in range(n))
        done = {"name": name, "status": "succeeded"}
        wait_until(lambda: client.collection.count_documents(done) == n, timeout=600)
        w1, m1 = tree_cpu_seconds(proc.pid), _cpu_s(mongod_pid)
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
        bench.record(
            Result(
                f"WBH {mode}",
                f"{median(mode, 'rate'):,.0f} tasks/s"
                + ("" if ratio is None else f" = {ratio:.2f}x {PAIRS[mode]}"),
                "(no target)" if ratio is None else f"≥ 2x {PAIRS[mode]}",
                None if ratio is None else ratio >= 2.0,
                f"{n:,} no-op tasks, {rounds} rounds alternated; worker "
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
