"""Handlers of the usage tests run by worker processes (`mtask-worker usageapp:registry`): each
step of a ``racer`` says it started (a log line kept with the run), spends a while in flight,
then records 100 tokens."""

from __future__ import annotations

import asyncio
from typing import Any

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
