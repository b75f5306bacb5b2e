"""A shop's workflow, published by a trigger (docs/triggers.md, docs/steps.md), for tests that
start worker processes (``mtask-worker shopapp:registry``): a paid order publishes ``fulfil``,
which charges in a step, spawns a ``pack`` child per item (sku ``broken`` fails, and the
workflow carries on), spawns a ``mail``, then waits for the signal ``shipped``."""

from __future__ import annotations

import contextlib
from typing import Any

from mtask import ChildFailed, Registry, TaskContext

registry = Registry()


@registry.task("pack", options={"max_retries": 0})
def pack(params: dict[str, Any]) -> str:
    if params["sku"] == "broken":
        raise ValueError("no stock for broken")
    return f"packed {params['sku']}"


@registry.task("mail")
def mail(params: dict[str, Any]) -> dict[str, Any]:
    return {"to": params["to"], "sent": True}


@registry.task("fulfil")
async def fulfil(params: dict[str, Any], ctx: TaskContext) -> Any:
    await ctx.step("charge", lambda: f"ch_{params['_id']}")
    with contextlib.suppress(ChildFailed):  # a missing item does not stop the order
        await ctx.spawn_and_wait([("pack", {"sku": sku}) for sku in params["items"]])
    await ctx.spawn_and_wait([("mail", {"to": params["email"]})], name="mail")
    return await ctx.wait_for("shipped")


registry.trigger(
    "orders", task="fulfil", match={"status": "paid"}, params=["items", "email"], key="document"
)
