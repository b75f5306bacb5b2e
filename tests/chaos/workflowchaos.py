"""Handlers of the workflow chaos tests, run by real ``mtask-worker`` processes: a parent that
spawns children and awaits them, children whose one effect commits with their step (exactly
once for MongoDB), and three parallel steps of which the third waits to be let go. Effects and
calls are counted in the ``effects`` and ``calls`` collections of ``CHAOS_DB``."""

from __future__ import annotations

import asyncio
import os
from typing import Any

from pymongo import AsyncMongoClient

from mtask.registry import Registry, TaskContext
from mtask.steps.children import Spawn

registry = Registry()
LEASE = {"worker_timeout_ms": 3000, "ping_interval_ms": 500}
_clients: dict[str, Any] = {}


def _db() -> Any:
    if "c" not in _clients:
        _clients["c"] = AsyncMongoClient(os.environ["CHAOS_URI"], w="majority", tz_aware=True)
    return _clients["c"][os.environ["CHAOS_DB"]]


async def _retrying(write: Any) -> None:
    for attempt in range(60):  # the primary may be failing over: keep the entry
        try:
            await write()
            return
        except Exception:  # noqa: BLE001 - retried; the test fails if the entry is missing
            await asyncio.sleep(min(0.05 * 2**attempt, 1.0))
    raise RuntimeError("cannot write a count")


@registry.task("fan_parent")
async def fan_parent(params: dict[str, Any], ctx: TaskContext) -> list[Any]:
    kids = [Spawn("fan_child", {"n": n}, options=LEASE) for n in range(params["n"])]
    return await ctx.spawn_and_wait(kids, name="kids")


@registry.task("fan_child")
async def fan_child(params: dict[str, Any], ctx: TaskContext) -> int:
    async def work(*, session: Any) -> int:
        effects = session.client[os.environ["CHAOS_DB"]]["effects"]
        await effects.insert_one({"key": ctx.key, "worker": ctx.worker_id}, session=session)
        return int(params["n"]) * 3

    return int(await ctx.step("work", work, transactional=True))


@registry.task("three")
async def three(params: dict[str, Any], ctx: TaskContext) -> list[Any]:
    async def part(name: str) -> str:
        await _retrying(lambda: _db()["calls"].insert_one({"key": ctx.key, "step": name}))
        while name == "c" and not await _db()["release"].find_one({"_id": ctx.key}):  # noqa: ASYNC110
            await asyncio.sleep(0.05)  # the first run is killed while it waits here
        return name.upper()

    return await ctx.gather(*(ctx.step(n, part, n) for n in ("a", "b", "c")))
