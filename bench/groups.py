"""Bench WG, groups: what fairness, per-group limits and sequences cost a drain.

One worker (concurrency 64, W1's) drains ``n`` no-op tasks on a mongod of the bench's own,
once per mode, the modes alternated over ``ROUNDS`` rounds:

- ``plain``: no group (the baseline);
- ``grouped``: spread over 100 groups, no limit (the claim queue's turns between groups);
- ``limited``: the same with ``group_concurrency=2`` (a slot per run in each group's document);
- ``sequences``: spread over 1,000 groups with ``group_concurrency=1`` (each group one at a
  time, in publish order: its next task read, a slot taken).

Per mode: tasks per second (first claim to last success, median of the rounds) and its ratio
to ``plain`` in the same round; the worker's and mongod's CPU µs per task; and the server's
round trips per task by command (``metrics.commands``: a bulk write of 64 updates is one
``update``), which shows whether limited names are claimed in batches.
"""

from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING, Any

from pymongo import MongoClient

from bench.support import (
    QUICK,
    Result,
    alternated,
    medians,
    runs_span,
    wait_until,
    worker_and_client,
)

if TYPE_CHECKING:
    from bench.workloads import Bench

MODES = {
    "plain": (None, None),
    "grouped": (100, None),
    "limited": (100, 2),
    "sequences": (1000, 1),
}
COMMANDS = ("update", "findAndModify", "find", "aggregate", "getMore")


def _commands(mongo: MongoClient[dict[str, Any]]) -> dict[str, int]:
    counted = mongo.admin.command("serverStatus")["metrics"]["commands"]
    return {c: int(counted.get(c, {}).get("total", 0)) for c in COMMANDS}


def _one(uri: str, mongod_pid: int, mode: str, n: int, round_: int) -> dict[str, float]:
    from bench.cpu import tree_cpu_seconds
    from bench.scale import _cpu_s

    groups, limit = MODES[mode]
    database = f"wg_{mode}_{round_}"
    with worker_and_client(uri, database, "--concurrency", "64") as (proc, client):
        if limit is not None:
            client.set_limit("noop", group_concurrency=limit)
            time.sleep(0.3)  # the worker's gate hears of the limit (its event)
        items = [
            {
                "name": "noop",
                "key": f"t{i:06d}",
                **({} if groups is None else {"options": {"group": f"g{i % groups:04d}"}}),
            }
            for i in range(n)
        ]
        mongo = client.mongo
        w0, m0, c0 = tree_cpu_seconds(proc.pid), _cpu_s(mongod_pid), _commands(mongo)
        client.publish_many(items)
        done = {"name": "noop", "status": "succeeded"}
        wait_until(lambda: client.collection.count_documents(done) == n, timeout=600)
        w1, m1, c1 = tree_cpu_seconds(proc.pid), _cpu_s(mongod_pid), _commands(mongo)
        seconds = max(runs_span(client.collection), 1e-3)
        return {
            "rate": n / seconds,
            "worker_us": (w1 - w0) * 1e6 / n,
            "mongod_us": (m1 - m0) * 1e6 / n,
            **{f"rt_{c}": (c1[c] - c0[c]) / n for c in COMMANDS},
        }


ROUNDS = 3


def _shape(mode: str) -> str:
    groups, limit = MODES[mode]
    if groups is None:
        return "no group"
    return f"{groups} groups" + ("" if limit is None else f", group_concurrency {limit}")


def groups_cost(bench: Bench) -> None:
    from bench.scale import _own_mongod

    quick = bench.sizes is QUICK
    n, rounds = (1000, 1) if quick else (5000, ROUNDS)
    with _own_mongod() as (uri, pid, _port):
        figures = alternated(list(MODES), rounds, lambda mode, r: _one(uri, pid, mode, n, r))
    median = medians(figures)

    ratios = {
        mode: statistics.median(
            f["rate"] / p["rate"] for f, p in zip(figures[mode], figures["plain"], strict=True)
        )
        for mode in MODES
    }
    targets = {"grouped": 0.8, "sequences": 0.6}
    for mode in MODES:
        trips = ", ".join(
            f"{c} {median(mode, f'rt_{c}'):.3f}" for c in COMMANDS if median(mode, f"rt_{c}") > 0
        )
        target = targets.get(mode)
        bench.record(
            Result(
                f"WG {mode}",
                f"{median(mode, 'rate'):,.0f} tasks/s = {ratios[mode]:.2f}x plain",
                f"≥ {target}x plain" if target else "(no target)",
                None if target is None else ratios[mode] >= target,
                f"{n:,} no-op tasks, {_shape(mode)}; worker {median(mode, 'worker_us'):.0f} µs, "
                f"mongod {median(mode, 'mongod_us'):.0f} µs a task; round trips a task: {trips}",
                {
                    "per_s": median(mode, "rate"),
                    "ratio": ratios[mode],
                    "worker_us": median(mode, "worker_us"),
                    "mongod_us": median(mode, "mongod_us"),
                },
            )
        )
