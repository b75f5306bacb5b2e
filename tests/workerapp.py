"""Handlers used by the worker tests (also run by `mtask-worker workerapp:registry`)."""

from __future__ import annotations

import asyncio
import time

from pydantic import BaseModel

from mtask.registry import Fail, Registry, Retry, TaskContext

registry = Registry()


class AddParams(BaseModel):
    a: int
    b: int


@registry.task("add")
async def add(params: AddParams) -> int:
    return params.a + params.b


@registry.task("echo")
def echo(params: dict[str, object], ctx: TaskContext) -> dict[str, object]:
    return {"params": params, "worker": ctx.worker_id, "attempt": ctx.attempt}


@registry.task("sleep")
async def sleep(params: dict[str, float]) -> str:
    await asyncio.sleep(params.get("seconds", 3600))
    return "slept"


@registry.task("wait_cancel")
async def wait_cancel(params: dict[str, object], ctx: TaskContext) -> str:
    await ctx.cancelled.wait()
    return "should not be recorded"


@registry.task("flaky")
def flaky(params: dict[str, int], ctx: TaskContext) -> str:
    if ctx.attempt <= params.get("fail_times", 1):
        raise RuntimeError(f"flaky failure on attempt {ctx.attempt}")
    return "ok"


@registry.task("always_fails")
def always_fails(params: dict[str, object]) -> None:
    raise ValueError("this task always fails")


@registry.task("give_up")
def give_up(params: dict[str, object]) -> None:
    raise Fail("the input can never work")


@registry.task("retry_later")
def retry_later(params: dict[str, object], ctx: TaskContext) -> str:
    if ctx.attempt == 1:
        raise Retry("not ready", delay=0.05)
    return "ready"


@registry.task("block_loop")
async def block_loop(params: dict[str, float]) -> str:
    time.sleep(params["seconds"])  # blocks the event loop on purpose  # noqa: ASYNC251
    return "unblocked"


@registry.task("huge_result")
def huge_result(params: dict[str, object]) -> str:
    return "x" * (2 * 1024 * 1024)


@registry.task("follow_up")
async def follow_up(params: dict[str, object], ctx: TaskContext) -> str:
    await ctx.publish("add", f"{ctx.key}/next", {"a": 1, "b": 2})
    return "published"


@registry.task("too_deep")
def too_deep(params: dict[str, object]) -> dict[str, object]:
    result: dict[str, object] = {}
    for _ in range(200):  # BSON can encode it; the server refuses nesting this deep
        result = {"x": result}
    return result


cleaned_up: set[str] = set()


@registry.task("slow_cleanup")
async def slow_cleanup(params: dict[str, object], ctx: TaskContext) -> None:
    try:
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        await asyncio.sleep(0.2)  # cleanup that awaits: a second cancel would cut it short
        cleaned_up.add(ctx.key)
        raise


@registry.task("chatter")
async def chatter(params: dict[str, int], ctx: TaskContext) -> int:
    """Emits chunk i (1, 2, ...) every ``every_ms`` until ``count`` chunks, reporting progress
    with each; a second attempt (a takeover) goes on from where the stream stands."""
    count, every = params.get("count", 100), params.get("every_ms", 20) / 1000
    for i in range(1, count + 1):
        ctx.emit({"i": i, "attempt": ctx.attempt})
        ctx.progress(i / count, f"chunk {i} of {count}")
        if i % 10 == 0:
            ctx.log.info("chunks so far", i=i)
        await asyncio.sleep(every)
    return count
