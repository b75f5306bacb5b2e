"""Handlers that wait on data (``ctx.wait_until``; docs/triggers.md), at module level so that a
process-isolated one can be imported by a pool child."""

from __future__ import annotations

from typing import Any

from mtask.registry import Registry, TaskContext
from mtask.steps import ConditionTimeout

registry = Registry()
registry.waits_on("invoices")


@registry.task("settle")
async def settle(params: dict[str, Any], ctx: TaskContext) -> Any:
    """Waits until its invoice is settled; returns the invoice's total then."""
    invoice = await ctx.wait_until(
        "invoices", {"_id": params["invoice"], "status": "settled"}, timeout=params.get("timeout")
    )
    return invoice["total"]


@registry.task("settle_or_give_up")
async def settle_or_give_up(params: dict[str, Any], ctx: TaskContext) -> str:
    try:
        await ctx.wait_until(
            "invoices", {"_id": params["invoice"], "status": "settled"}, timeout=params["timeout"]
        )
    except ConditionTimeout:
        return "gave up"
    return "settled"


@registry.task("settle_in_thread")
def settle_in_thread(params: dict[str, Any], ctx: TaskContext) -> Any:
    invoice = ctx.wait_until_sync("invoices", {"_id": params["invoice"], "status": "settled"})
    return invoice["total"]


@registry.task("settle_in_child", isolation="process")
def settle_in_child(params: dict[str, Any], ctx: TaskContext) -> Any:
    invoice = ctx.wait_until_sync("invoices", {"_id": params["invoice"], "status": "settled"})
    return invoice["total"]


@registry.task("undeclared")
async def undeclared(params: dict[str, Any], ctx: TaskContext) -> Any:
    return await ctx.wait_until("payments", {"_id": 1, "done": True})


@registry.task("any_settled")
async def any_settled(params: dict[str, Any], ctx: TaskContext) -> Any:
    """Waits until one of its invoices is settled (a wait on many documents): which one."""
    found = await ctx.wait_until(
        "invoices", {"_id": {"$in": params["invoices"]}, "status": "settled"}
    )
    return found["_id"]
