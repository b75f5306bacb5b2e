"""The registry the benchmark workers run (``bench.app:registry``)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from bench import batches, children, features_off, output, preflight, steps, txn
from mtask.registry import Registry, TaskContext

features_off.apply()  # bench WB's worker-side variants (MTASK_BENCH_OFF); none by default
registry = Registry()
txn.register(registry)
output.register(registry)
steps.register(registry)
children.register(registry)  # bench WC
preflight.register(registry)  # bench WF
batches.register(registry)  # bench WBH


@registry.task("noop")
async def noop(params: dict[str, Any]) -> None:
    return None


@registry.task("echo")
async def echo(params: dict[str, Any]) -> dict[str, Any]:
    return {"i": params.get("i")}


@registry.task("stamp")
async def stamp(params: dict[str, Any], ctx: TaskContext) -> float:
    return time.time()  # handler start, on the same host as the publisher


@registry.task("span")
async def span(params: dict[str, Any]) -> list[float]:
    """Sleeps ``ms``; returns its handler's own start and end (this host's clock: bench WL)."""
    start = time.time()
    await asyncio.sleep(params.get("ms", 200) / 1000)
    return [start, time.time()]


@registry.task("linger")
async def linger(params: dict[str, Any]) -> float:
    """Runs ``ms`` milliseconds; returns when it started (bench WR: a run taken over)."""
    started = time.time()
    await asyncio.sleep(params["ms"] / 1000)
    return started


@registry.task("hold")
async def hold(params: dict[str, Any]) -> None:
    await asyncio.sleep(3600)
