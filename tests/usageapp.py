"""Handlers of the usage tests run by worker processes (`mtask-worker usageapp:registry`): each
step of a ``racer`` says it started (a log line kept with the run), spends a while in flight,
then records 100 tokens."""

from __future__ import annotations

import asyncio
from typing import Any

from pymongo import AsyncMongoClient

from mtask.registry import Registry, TaskContext

registry = Registry()
registry.price("small", input=1.0, output=4.0)  # per million tokens

STEP_TOKENS = 100
"""What one step of a racer spends (70 in, 30 out)."""


async def _slow_call(ctx: TaskContext, n: int) -> None:
    ctx.log.info("started", step=n)
    await asyncio.sleep(0.05)  # in flight a while: other workers' steps start meanwhile
    await ctx.record_usage("small", input_tokens=70, output_tokens=30)


@registry.task("racer", options={"retry_delay_ms": 0})
async def racer(params: dict[str, Any], ctx: TaskContext) -> int:
    for n in range(params["steps"]):
        await ctx.step(f"call{n}", _slow_call, ctx, n)
    return params["steps"]


METERED_TOKENS = 100
"""What one run of ``metered`` charges to the resource ``llm`` (60 in, 40 out)."""
_side_clients: dict[str, Any] = {}


def _side(params: dict[str, Any]) -> Any:
    """A client of the test's server, one per event loop (an in-process worker's tests each
    run their own loop, and a client serves the loop it was first used on)."""
    at = f"{params['uri']}#{id(asyncio.get_running_loop())}"
    if at not in _side_clients:
        _side_clients[at] = AsyncMongoClient(str(params["uri"]), w="majority", tz_aware=True)
    return _side_clients[at][str(params["db"])]


@registry.task("metered", uses=["llm"], options={"retry_delay_ms": 0})
async def metered(params: dict[str, Any], ctx: TaskContext) -> int:
    """One model call through the shared resource ``llm``: its charge bracketed by two notes
    of the server's time (``charges``: ``before`` and ``after``, by run)."""
    db = _side(params)
    notes = db["charges"]
    await notes.update_one({"_id": ctx.run_id}, [{"$set": {"before": "$$NOW"}}], upsert=True)
    await ctx.record_usage("small", input_tokens=60, output_tokens=40)
    after = {"after": "$$NOW", "tokens": METERED_TOKENS, "key": ctx.key}
    await notes.update_one({"_id": ctx.run_id}, [{"$set": after}])
    return METERED_TOKENS


STEP_CHARGE = 100
"""What one step of ``metered_steps`` charges to the resource ``llm`` (70 in, 30 out)."""


async def _bracketed_call(ctx: TaskContext, params: dict[str, Any], n: int) -> int:
    """One model call of a step: its charge bracketed by two notes of the server's time
    (``charges``: ``before`` and ``after``, by run and step)."""
    notes = _side(params)["charges"]
    note = {"_id": f"{ctx.run_id}:{n}"}
    await notes.update_one(note, [{"$set": {"before": "$$NOW"}}], upsert=True)
    await ctx.record_usage("small", input_tokens=70, output_tokens=30)
    after = {"after": "$$NOW", "tokens": STEP_CHARGE, "key": ctx.key, "step": n}
    await notes.update_one(note, [{"$set": after}])
    return STEP_CHARGE


@registry.task("metered_steps", uses=["llm"], options={"retry_delay_ms": 0})
async def metered_steps(params: dict[str, Any], ctx: TaskContext) -> int:
    """``params["steps"]`` model calls through the shared resource ``llm``, each its own
    step: each is admitted by the resource's window of tokens before it starts."""
    for n in range(params["steps"]):
        await ctx.step(f"call{n}", _bracketed_call, ctx, params, n)
    return params["steps"] * STEP_CHARGE
