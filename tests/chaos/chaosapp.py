"""Handlers for the chaos suite, run by real ``mtask-worker`` processes.

Every handler writes what it does to the ``execlog`` collection of the database named by
``CHAOS_DB`` (on ``CHAOS_URI``): one entry per start and per end (``finish``, ``fail`` or
``cancelled``), with the key, run id, worker id and the *server's* time (``$$NOW``), so that the
invariants can be checked across processes from one clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from typing import Any

from bson import ObjectId
from pymongo import AsyncMongoClient, MongoClient

from mtask.limits.holds import BackOff
from mtask.registry import Registry, TaskContext

registry = Registry()
_clients: dict[str, Any] = {}


def _collection(sync: bool = False) -> Any:
    kind = "sync" if sync else "async"
    if kind not in _clients:
        cls = MongoClient if sync else AsyncMongoClient
        _clients[kind] = cls(os.environ["CHAOS_URI"], w="majority", tz_aware=True)
    return _clients[kind][os.environ["CHAOS_DB"]]["execlog"]


def _entry(ctx: TaskContext, event: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    fields = {"key": ctx.key, "run_id": ctx.run_id, "worker_id": ctx.worker_id, "event": event}
    return {"_id": ObjectId()}, [{"$set": {**fields, "at": "$$NOW"}}]


async def log(ctx: TaskContext, event: str) -> None:
    filt, update = _entry(ctx, event)
    for attempt in range(60):  # MongoDB may be restarting or failing over: keep the entry
        try:
            await _collection().update_one(filt, update, upsert=True)
            return
        except Exception:  # noqa: BLE001 - retried; the test fails if the entry is missing
            await asyncio.sleep(min(0.05 * 2**attempt, 1.0))
    raise RuntimeError("cannot write the execution log")


def log_sync(ctx: TaskContext, event: str) -> None:
    filt, update = _entry(ctx, event)
    _collection(sync=True).update_one(filt, update, upsert=True)


async def stopped(ctx: TaskContext, start: asyncio.Future[None]) -> None:
    """Log a run's ``cancelled`` end, after its ``start`` entry: a run may be stopped while
    its start is still being written (a worker frozen right after the write reached MongoDB
    wakes up to find its lease gone), and its entries must still read start, then cancelled."""
    await start
    await log(ctx, "cancelled")


@registry.task("work")
async def work(params: dict[str, Any], ctx: TaskContext) -> str:
    """Sleeps ``ms`` (or ``ms_by_worker[worker id]``); fails on attempts up to
    ``fail_attempts``."""
    ms = params.get("ms_by_worker", {}).get(ctx.worker_id, params.get("ms", 50))
    start = asyncio.ensure_future(log(ctx, "start"))
    try:
        await asyncio.shield(start)
        await asyncio.sleep(ms / 1000)
    except asyncio.CancelledError:
        await stopped(ctx, start)
        raise
    if ctx.attempt <= params.get("fail_attempts", 0):
        await log(ctx, "fail")
        raise RuntimeError(f"planned failure on attempt {ctx.attempt}")
    await log(ctx, "finish")
    return "ok"


@registry.task("api_a", uses=["api"])
async def api_a(params: dict[str, Any], ctx: TaskContext) -> str:
    """``work`` under a name that shares the resource ``api``."""
    return await work(params, ctx)


@registry.task("api_b", uses=["api"])
async def api_b(params: dict[str, Any], ctx: TaskContext) -> str:
    return await work(params, ctx)


@registry.task("api_c", uses=["api", "unset"])  # a resource with no limit limits nothing
async def api_c(params: dict[str, Any], ctx: TaskContext) -> str:
    return await work(params, ctx)


@registry.task("call_api")
async def call_api(params: dict[str, Any], ctx: TaskContext) -> str:
    """``work``, but a task whose params say ``back_off`` (seconds) holds its group that long on
    its first attempt, as after an HTTP 429."""
    if params.get("back_off") and ctx.attempt == 1:
        await log(ctx, "back_off")
        raise BackOff(params["back_off"], group=True)
    return await work(params, ctx)


@registry.task("hang")
async def hang(params: dict[str, Any], ctx: TaskContext) -> None:
    """Never returns; only cancellation stops it."""
    start = asyncio.ensure_future(log(ctx, "start"))
    try:
        await asyncio.shield(start)
        await asyncio.Event().wait()
    except asyncio.CancelledError:
        await stopped(ctx, start)
        raise


@registry.task("stubborn")
async def stubborn(params: dict[str, Any], ctx: TaskContext) -> None:
    """Never returns, and swallows every cancel: one that comes while it logs its start too
    (the test sees the start once it is written, before this await returns)."""
    with contextlib.suppress(asyncio.CancelledError):
        await log(ctx, "start")
    while True:
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(1)


@registry.task("hang_thread")
def hang_thread(params: dict[str, Any], ctx: TaskContext) -> None:
    """A plain-def handler that hangs forever and ignores ``ctx.cancelled``."""
    log_sync(ctx, "start")
    while True:
        time.sleep(1)


@registry.task("block_loop")
async def block_loop(params: dict[str, Any], ctx: TaskContext) -> str:
    """Blocks the worker's event loop for ``seconds``."""
    await log(ctx, "start")
    time.sleep(params["seconds"])  # noqa: ASYNC251 - blocking the loop is the point
    await log(ctx, "finish")
    return "unblocked"


@registry.task("charge", transactional=True)
async def charge(params: dict[str, Any], ctx: TaskContext) -> str:
    """Transactional: one ``ledger`` document and one increment of the task's ``counters``
    document per run, with ``ctx.session``; logs ``written`` (outside the transaction) once they
    are written, then waits ``hold_ms`` (or ``hold_ms_by_worker[worker id]``) before returning,
    i.e. before mtask commits them with the SUCCESS."""
    db = ctx.session.client[os.environ["CHAOS_DB"]]
    entry = {"task": ctx.key, "run_id": ctx.run_id, "worker_id": ctx.worker_id}
    await db["ledger"].insert_one(entry, session=ctx.session)
    await db["counters"].update_one(
        {"_id": ctx.key}, {"$inc": {"n": 1}}, upsert=True, session=ctx.session
    )
    await log(ctx, "written")
    hold = params.get("hold_ms_by_worker", {}).get(ctx.worker_id, params.get("hold_ms", 0))
    await asyncio.sleep(hold / 1000)
    return "charged"


async def armed(what: str = "armed") -> None:
    """Wait until the test writes the document ``what`` into ``armed`` (``armed``: the server
    holds this worker's writes; ``released``: the held writes have run)."""
    side = _collection().database["armed"]
    for _ in range(1200):
        if await side.find_one({"_id": what}) is not None:
            return
        await asyncio.sleep(0.05)
    raise RuntimeError(f"never {what}")


async def effect(ctx: TaskContext, what: str) -> str:
    """A step's side effect, counted in ``effects`` (one entry per call, by run)."""
    effects = _collection().database["effects"]
    await effects.insert_one({"key": ctx.key, "what": what, "run_id": ctx.run_id})
    return f"{what} by {ctx.worker_id}"


@registry.task("zombie_steps")
async def zombie_steps(params: dict[str, Any], ctx: TaskContext) -> dict[str, Any]:
    """A step, then (once ``armed``) a log line and a second step; returns who ran it. The
    rescuer goes on only once the zombie's held writes have run (while its own run is
    RUNNING: the fence, not the task's end, must refuse them)."""
    first = await ctx.step("first", effect, ctx, "first")
    await log(ctx, "start")
    await armed()
    if ctx.worker_id == "rescuer":
        await armed("released")
    ctx.log.info("line", worker=ctx.worker_id)
    second = await ctx.step("second", effect, ctx, "second")
    return {"first": first, "second": second, "by": ctx.worker_id}


@registry.task("zombie_outcome")
async def zombie_outcome(params: dict[str, Any], ctx: TaskContext) -> dict[str, Any]:
    """Returns (once ``armed``) who ran it: its outcome is the write the server holds. The
    rescuer returns only once the zombie's held writes have run."""
    await log(ctx, "start")
    await armed()
    if ctx.worker_id == "rescuer":
        await armed("released")
    return {"by": ctx.worker_id}


@registry.task("seq_thread", time_limit=1.5)
def seq_thread(params: dict[str, Any], ctx: TaskContext) -> str:
    """A plain-def handler that ignores its stop (``ctx.cancelled``): logs ``start``, sleeps
    ``ms`` (or ``ms_by_attempt[attempt]``), logs ``end`` as its thread returns. Its hard time
    limit is 1.5 s."""
    ms = params.get("ms_by_attempt", {}).get(str(ctx.attempt), params.get("ms", 50))
    log_sync(ctx, "start")
    time.sleep(ms / 1000)
    log_sync(ctx, "end")
    return "done"
