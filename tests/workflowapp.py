"""Handlers of the workflow tests that cross processes (a preflight's sandbox imports them by
name): three versions of one handler for the changed-code test, and one that does I/O between
its steps. ``EFFECTS`` names the database where the handlers count their side effects."""

from __future__ import annotations

import os
import socket
from typing import Any

from pymongo import MongoClient

from mtask import Registry, TaskContext

EFFECTS: dict[str, str] = {}
"""``uri`` and ``db`` of the side collection ``effects`` (set by the test)."""


def effect(key: str, what: str) -> str:
    client: MongoClient[dict[str, Any]] = MongoClient(EFFECTS["uri"])
    try:
        client[EFFECTS["db"]]["effects"].insert_one({"key": key, "what": what})
    finally:
        client.close()
    return what


async def charge(ctx: TaskContext) -> None:
    await ctx.step("charge", effect, ctx.key, "charge")


async def ship(ctx: TaskContext) -> None:
    await ctx.step("ship", effect, ctx.key, "ship")


v1 = Registry()
v2 = Registry()
v3 = Registry()
v3_deprecated = Registry()


@v1.task("ship_order")
async def ship_v1(params: dict[str, Any], ctx: TaskContext) -> str:
    await charge(ctx)
    await ctx.wait_for("go")
    await ship(ctx)
    return "v1"


@v2.task("ship_order")
async def ship_v2(params: dict[str, Any], ctx: TaskContext) -> str:
    await charge(ctx)
    if ctx.patched("ship-first"):
        await ship(ctx)
        await ctx.wait_for("go")
        return "v2-new"
    await ctx.wait_for("go")
    await ship(ctx)
    return "v2-old"


@v3.task("ship_order")
async def ship_v3(params: dict[str, Any], ctx: TaskContext) -> str:
    await charge(ctx)
    await ship(ctx)
    await ctx.wait_for("go")
    return "v3"


@v3_deprecated.task("ship_order")
async def ship_v3_deprecated(params: dict[str, Any], ctx: TaskContext) -> str:
    await charge(ctx)
    ctx.deprecate_patch("ship-first")
    await ship(ctx)
    await ctx.wait_for("go")
    return "v3"


@v3.task("leaky")
async def leaky(params: dict[str, Any], ctx: TaskContext) -> str:
    await ctx.step("first", lambda: 1)
    if params.get("connect"):  # I/O between two steps: a dry replay refuses it
        socket.create_connection(("127.0.0.1", 9), timeout=0.1)
    if params.get("write"):
        with open(os.devnull, "w") as sink:  # noqa: ASYNC230 - the I/O under test
            sink.write("x")
    await ctx.wait_for("go")
    return "leaky"


@v1.task("leaky")
async def leaky_v1(params: dict[str, Any], ctx: TaskContext) -> str:
    await ctx.step("first", lambda: 1)
    await ctx.wait_for("go")
    return "leaky"


in_child = Registry()
"""Issue 61's features in a process-isolated plain-def handler (its child asks the worker over
its pipe): parallel steps on threads, a value decided once, a loop, children awaited."""


@in_child.task("child_workflow", isolation="process")
def child_workflow(params: dict[str, Any], ctx: TaskContext) -> dict[str, Any]:
    a, b = ctx.gather_sync(lambda: ctx.step_sync("a", int, 1), lambda: ctx.step_sync("b", int, 2))
    when = ctx.now()
    looped = [ctx.step_sync("loop", int, n) for n in range(2)]
    kids = ctx.spawn_and_wait_sync([("double", {"n": 3}), ("double", {"n": 4})])
    return {"a": a, "b": b, "looped": looped, "kids": kids, "pid": os.getpid(), "now": str(when)}


@in_child.task("double")
async def double(params: dict[str, Any]) -> int:
    return int(params["n"]) * 2


@v1.task("pay")
@v2.task("pay")
async def pay(params: dict[str, Any], ctx: TaskContext) -> str:
    """Reads its (encrypted) params before and after its wait: a replay that handed it
    ciphertext would fail on ``card``."""
    card = str(params["card"])
    await ctx.step("charge", effect, ctx.key, f"charge {card[-4:]}")
    await ctx.wait_for("go")
    return card[-4:]
