"""A workflow whose execution graph the dashboard draws (the graph tests run it in a worker
process or in the test's loop): an ``order`` that continues as new once, then calls a step
that fails on its first call (the task's retry calls it again), sleeps, waits for a signal
that does not come, runs two steps in parallel and spawns two ``pack`` children, one of which
fails for good: the order fails in its spawn."""

from __future__ import annotations

import contextlib
from typing import Any

from mtask import Registry, TaskContext
from mtask.steps import SignalTimeout

registry = Registry()
CALLED: set[str] = set()
"""The orders whose stock check was called once in this process (the first call fails)."""


def check(key: str) -> str:
    if key not in CALLED:
        CALLED.add(key)
        raise RuntimeError("the inventory service answered 503")
    return "in stock"


@registry.task("order", options={"max_retries": 1, "retry_delay_ms": 0})
async def order(params: dict[str, Any], ctx: TaskContext) -> Any:
    again = int(params.get("again", 0))
    if again:
        await ctx.step("tick", lambda: again)
        ctx.continue_as_new({**params, "again": again - 1})
    await ctx.step("check", check, ctx.key)
    await ctx.sleep(0.2, name="cool-off")
    with contextlib.suppress(SignalTimeout):  # nobody sends it
        await ctx.wait_for("go", timeout=0.2)
    await ctx.gather(ctx.step("price", lambda: 10), ctx.step("stock", lambda: 3))
    return await ctx.spawn_and_wait([("pack", {"sku": "a"}), ("pack", {"sku": "broken"})])


@registry.task("pack", options={"max_retries": 0})
async def pack(params: dict[str, Any]) -> str:
    if params["sku"] == "broken":
        raise ValueError("no stock for broken")
    return f"packed {params['sku']}"
