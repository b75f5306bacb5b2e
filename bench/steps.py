"""Bench WS, durable steps: what a step, a sleep and a signal cost per task.

One worker (concurrency 8) drains ``n`` tasks of one handler on a mongod of the bench's own
(the CPU read from ``/proc`` is this workload's alone), once per mode:

- ``none``: a handler that uses no step (the baseline);
- ``steps``: the same handler with ``STEPS`` steps of a small result each;
- ``sleep``: one ``ctx.sleep(0.01)`` (the run ends WAITING; a second run replays and returns);
- ``signal``: ``ctx.wait_for`` a signal the bench sends once the run is waiting.

Per task, above ``none``: the worker's CPU µs, mongod's CPU µs and the server's operations
(``opcounters`` insert + query + update + command); for ``steps`` also per step.
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

if TYPE_CHECKING:
    from bench.workloads import Bench

STEPS = 5
MODES = ("none", "steps", "sleep", "signal")


def _small(i: int) -> dict[str, int]:
    return {"i": i}


async def stepper(params: dict[str, Any], ctx: TaskContext) -> int:
    mode = params["mode"]
    if mode == "steps":
        for i in range(STEPS):
            await ctx.step(f"s{i}", _small, i)
    elif mode == "sleep":
        await ctx.sleep(0.01)
    elif mode == "signal":
        await ctx.wait_for("go")
    return 0


def register(registry: Registry) -> None:
    registry.task("stepper")(stepper)


def _one(uri: str, mongod_pid: int, mode: str, n: int) -> dict[str, float]:
    database = f"ws_{mode}"
    with worker_and_client(uri, database, "--concurrency", "8") as (proc, client):
        mongo = client.mongo
        before = cost_reading(proc.pid, mongod_pid, mongo)
        began = time.monotonic()
        client.publish_many(
            {"name": "stepper", "key": f"{mode}-{i}", "params": {"mode": mode}} for i in range(n)
        )
        if mode == "signal":
            tasks = client.collection
            signalled: set[str] = set()

            def all_signalled() -> bool:
                for doc in tasks.find({"waiting.signal": "go"}, {"_id": 1}):
                    if doc["_id"] not in signalled:
                        client.signal(doc["_id"], "go")
                        signalled.add(doc["_id"])
                return len(signalled) == n

            wait_until(all_signalled, timeout=300)
        done = {"name": "stepper", "status": "succeeded"}  # stats() stops counting at 1,000
        wait_until(lambda: client.collection.count_documents(done) == n, timeout=300)
        wall = time.monotonic() - began
        after = cost_reading(proc.pid, mongod_pid, mongo)
        signal_ops = n * 1.0 if mode == "signal" else 0.0  # the bench's own signals
        return per_task(before, after, n, signal_ops, wall)


def durable_steps(bench: Bench) -> None:
    from bench.scale import _own_mongod

    n = 300 if bench.sizes is QUICK else 2000
    with _own_mongod() as (uri, pid, _port):
        figures = {mode: _one(uri, pid, mode, n) for mode in MODES}
    base = figures["none"]

    def above(mode: str, key: str, per: int = 1) -> float:
        return (figures[mode][key] - base[key]) / per

    rows = [
        f"a step: worker +{above('steps', 'worker_us', STEPS):.0f} µs, mongod "
        f"+{above('steps', 'mongod_us', STEPS):.0f} µs, +{above('steps', 'ops', STEPS):.2f} "
        "server ops",
        f"a sleep: worker +{above('sleep', 'worker_us'):.0f} µs, mongod "
        f"+{above('sleep', 'mongod_us'):.0f} µs, +{above('sleep', 'ops'):.1f} ops per task",
        f"a signal wait: worker +{above('signal', 'worker_us'):.0f} µs, mongod "
        f"+{above('signal', 'mongod_us'):.0f} µs, +{above('signal', 'ops'):.1f} ops per task "
        "(the signal's own update not counted)",
    ]
    bench.record(
        Result(
            "WS durable steps",
            "; ".join(rows),
            "measured (a handler with no step pays nothing)",
            None,
            f"above a handler with no step (worker {base['worker_us']:.0f} µs, mongod "
            f"{base['mongod_us']:.0f} µs, {base['ops']:.2f} server ops per task); {n} tasks a "
            f"mode, one worker at concurrency 8, own mongod",
            {f"{m}_{k}": v for m, f in figures.items() for k, v in f.items()},
        )
    )
