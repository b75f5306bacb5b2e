"""Handlers that put a task in the states ``states_scenario`` does not hold: a parent waiting
for its children, a wait on data, a snoozed run, and a back-off that blocks its group's next
task. Run by a worker process (``mtask worker run morestatesapp:registry``)."""

from __future__ import annotations

from typing import Any

from mtask import BackOff, Registry, Snooze, TaskContext

registry = Registry()
registry.waits_on("invoices")


@registry.task("fan_out")
async def fan_out(params: dict[str, Any], ctx: TaskContext) -> list[Any]:
    """Spawns three children that wait for a signal, and waits for them."""
    return await ctx.spawn_and_wait([("held", {"n": n}) for n in range(3)])


@registry.task("held")
async def held(params: dict[str, Any], ctx: TaskContext) -> Any:
    return await ctx.wait_for("go")


@registry.task("settle")
async def settle(params: dict[str, Any], ctx: TaskContext) -> Any:
    """Waits until its invoice is paid."""
    return await ctx.wait_until("invoices", {"_id": params["invoice"], "paid": True})


@registry.task("snoozer")
def snoozer(params: dict[str, Any]) -> None:
    raise Snooze(3600, "upstream busy")


@registry.task("polite")
def polite(params: dict[str, Any]) -> None:
    """Backs its group off for an hour (the provider said 429)."""
    raise BackOff(3600, group=True, reason="provider said 429")
