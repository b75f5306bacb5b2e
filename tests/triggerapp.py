"""A registry with a trigger and a waited-on collection, for tests that start worker processes
(``mtask-worker triggerapp:registry``; docs/triggers.md)."""

from __future__ import annotations

from typing import Any

from mtask.registry import Registry, TaskContext

registry = Registry()
registry.waits_on("invoices")


@registry.task("ship")
def ship(params: dict[str, Any]) -> Any:
    return params.get("total")


@registry.task("settle")
async def settle(params: dict[str, Any], ctx: TaskContext) -> Any:
    invoice = await ctx.wait_until("invoices", {"_id": params["invoice"], "status": "settled"})
    return invoice.get("total")


registry.trigger("orders", task="ship", match={"status": "paid"}, params=["total"])
