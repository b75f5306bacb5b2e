"""Bench WC, children awaited without a slot: what a spawned-and-awaited child costs
its parent and the server, beside the same no-op task published on its own, and how long a
fan-out of ``n`` children takes to come back to its parent.

One worker (concurrency 8) on a mongod of the bench's own (its CPU, read from ``/proc``, is
this workload's alone), once per mode:

- ``plain``: ``n`` no-op tasks published at once (the baseline per task);
- ``spawned``: one parent spawns ``n`` no-op children and awaits them (``ctx.spawn_and_wait``).

Per child, above a plain task: the worker's CPU µs, mongod's CPU µs and the server's
operations (``opcounters``: insert + query + update + command, the bench's own polling not
counted); the parent's share (its spawn, its wait, its resume and the results' read) is in the
totals. ``fan-out wall``: from the parent's publish to its SUCCESS.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from bench.support import (
    QUICK,
    Result,
    cost_reading,
    per_task,
    wait_until,
    worker_and_client,
)
from mtask.registry import Registry, TaskContext
from mtask.steps.children import Spawn

if TYPE_CHECKING:
    from bench.workloads import Bench


async def fan_parent(params: dict[str, Any], ctx: TaskContext) -> int:
    kids = [Spawn("fan_noop", {"i": i}) for i in range(params["n"])]
    results = await ctx.spawn_and_wait(kids, name="kids")
    return len(results)


async def fan_noop(params: dict[str, Any]) -> int:
    return int(params["i"])


def register(registry: Registry) -> None:
    registry.task("fan_parent")(fan_parent)
    registry.task("fan_noop")(fan_noop)


def _one(uri: str, mongod_pid: int, mode: str, n: int) -> dict[str, float]:
    database = f"wc_{mode}"
    with worker_and_client(uri, database, "--concurrency", "8") as (proc, client):
        mongo = client.mongo
        before = cost_reading(proc.pid, mongod_pid, mongo)
        began = time.monotonic()
        polls = 0
        if mode == "plain":
            client.publish_many(
                {"name": "fan_noop", "key": f"t{i}", "params": {"i": i}} for i in range(n)
            )
            done = {"name": "fan_noop", "status": "succeeded"}

            def finished() -> bool:
                nonlocal polls
                polls += 1
                return client.collection.count_documents(done) == n

        else:
            client.publish("fan_parent", "parent", {"n": n})

            def finished() -> bool:
                nonlocal polls
                polls += 1
                doc = client.collection.find_one({"_id": "parent"}, {"status": 1})
                return (doc or {}).get("status") == "succeeded"

        wait_until(finished, timeout=900)
        wall = time.monotonic() - began
        after = cost_reading(proc.pid, mongod_pid, mongo)
        own = polls + 1  # the bench's polls and its publish
        return per_task(before, after, n, own, wall)


def children_cost(bench: Bench) -> None:
    from bench.scale import _own_mongod

    n = 1000 if bench.sizes is QUICK else 10_000
    with _own_mongod() as (uri, pid, _port):
        figures = {mode: _one(uri, pid, mode, n) for mode in ("plain", "spawned")}
    plain, spawned = figures["plain"], figures["spawned"]
    bench.record(
        Result(
            "WC children awaited",
            f"a spawned-and-awaited child: worker +{spawned['worker_us'] - plain['worker_us']:.0f}"
            f" µs, mongod +{spawned['mongod_us'] - plain['mongod_us']:.0f} µs, "
            f"+{spawned['ops'] - plain['ops']:.2f} server ops above a plain task; "
            f"{n} children back to their parent in {spawned['wall']:.1f} s "
            f"(plain: {plain['wall']:.1f} s)",
            "measured (a handler that spawns nothing pays nothing)",
            None,
            f"per child, the parent's spawn, wait, resume and results' read included; a plain "
            f"task: worker {plain['worker_us']:.0f} µs, mongod {plain['mongod_us']:.0f} µs, "
            f"{plain['ops']:.2f} server ops; one worker at concurrency 8, own mongod",
            {f"{m}_{k}": v for m, f in figures.items() for k, v in f.items()},
        )
    )
