"""Handlers used by the worker tests (also run by `mtask-worker workerapp:registry`)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from pydantic import BaseModel
from pymongo import AsyncMongoClient
from pymongo.errors import PyMongoError

from mtask.registry import Fail, Registry, Retry, TaskContext
from mtask.steps import SignalTimeout

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


@registry.task("rounds")
async def rounds(params: dict[str, Any], ctx: TaskContext) -> dict[str, Any]:
    """Continues as new (``ctx.continue_as_new``) with ``round`` one more, until ``until``;
    returns the params its last journal was given."""
    if params["round"] < params["until"]:
        ctx.continue_as_new({**params, "round": params["round"] + 1})
    return params


@registry.task("sleep")
async def sleep(params: dict[str, float]) -> str:
    await asyncio.sleep(params.get("seconds", 3600))
    return "slept"


@registry.task("timed_sleep")
async def timed_sleep(params: dict[str, float]) -> list[float]:
    """Sleeps, and returns when it started and ended on its process's monotonic clock: one
    clock for every run in that process, where the document's times are each worker's own
    estimate of the server's clock (two workers' may disagree by a millisecond)."""
    start = time.monotonic()
    await asyncio.sleep(params["seconds"])
    return [start, time.monotonic()]


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
    return "x" * int(params.get("bytes", 2 * 1024 * 1024))  # type: ignore[call-overload]


@registry.task("follow_up")
async def follow_up(params: dict[str, object], ctx: TaskContext) -> str:
    await ctx.publish("add", f"{ctx.key}/next", {"a": 1, "b": 2})
    return "published"


@registry.task("too_big")
def too_big(params: dict[str, object]) -> str:
    return "x" * 1_000_000  # within the result limit; its document has no room for it


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


# -- durable steps under faults (tests/integration/test_steps_faults.py) ---------------------
# The handlers write their side effects to the test's database (``params["db"]`` on
# ``params["uri"]``, majority-acknowledged, so a primary's death loses none the test saw).

_side_clients: dict[str, Any] = {}


def _side(params: dict[str, Any]) -> Any:
    uri = str(params["uri"])
    if uri not in _side_clients:
        _side_clients[uri] = AsyncMongoClient(uri, w="majority", tz_aware=True)
    return _side_clients[uri][str(params["db"])]


async def _note(db: Any, doc: dict[str, Any]) -> None:
    """Insert ``doc`` outside any transaction, retried while MongoDB fails over."""
    for attempt in range(100):
        try:
            await db["step_notes"].insert_one(dict(doc))
            return
        except PyMongoError:
            await asyncio.sleep(min(0.05 * 2**attempt, 0.5))
    raise RuntimeError("cannot write a step note")


async def _until_stopped(ctx: TaskContext, db: Any, limit_s: float = 120) -> None:
    """Note ``blocked``, then wait until the worker stops the run (its lease lost), ignoring
    the cancellation wherever it comes (the process may be frozen before the note's reply came
    back): the caller goes on as if nothing happened, the way a step function that ignores
    cancellation would."""

    async def blocked() -> None:
        await _note(db, {"task": ctx.key, "run_id": ctx.run_id, "event": "blocked"})
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(limit_s):
                await ctx.cancelled.wait()

    inner = asyncio.ensure_future(blocked())
    while True:
        try:
            await asyncio.shield(inner)
            return
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None:
                current.uncancel()
            if inner.done():
                inner.result()
                return


@registry.task("step_chain")
async def step_chain(params: dict[str, Any], ctx: TaskContext) -> list[dict[str, Any]]:
    """``count`` (5) durable steps ``s1``, ``s2``, …; step i inserts ``{task, step: i, run_id,
    worker}`` into ``step_rows`` and returns ``{step: i, run_id}``. ``hold_after`` (worker id to
    step number): that worker's run waits forever once that step is recorded (the test kills
    it). ``block_in`` (worker id to step number): that worker's step function, after its row,
    waits until the run is stopped (lease lost), swallows the cancellation and returns, so the
    step's record is attempted; how it went is noted in ``step_notes`` (``event: "record"``,
    ``error``: the exception's class name, or ``None`` if it was recorded)."""
    db = _side(params)
    hold_after = params.get("hold_after", {}).get(ctx.worker_id)
    block_in = params.get("block_in", {}).get(ctx.worker_id)
    results: list[dict[str, Any]] = []
    for i in range(1, int(params.get("count", 5)) + 1):

        async def fn(i: int) -> dict[str, Any]:
            row = {"task": ctx.key, "step": i, "run_id": ctx.run_id, "worker": ctx.worker_id}
            await db["step_rows"].insert_one(row)
            if i == block_in:
                await _until_stopped(ctx, db)
            return {"step": i, "run_id": ctx.run_id}

        note = {"task": ctx.key, "step": i, "event": "record", "run_id": ctx.run_id}
        try:
            results.append(await ctx.step(f"s{i}", fn, i))
        except Exception as exc:
            if i == block_in:
                await _note(db, {**note, "error": type(exc).__name__})
            raise
        if i == block_in:
            await _note(db, {**note, "error": None})
        if i == hold_after:
            await asyncio.sleep(3600)
    return results


@registry.task("continue_chain")
async def continue_chain(params: dict[str, Any], ctx: TaskContext) -> int:
    """One durable step ``s`` a journal, inserting ``{task, gen, run_id, worker}`` into
    ``step_rows``, then ``ctx.continue_as_new`` with ``gen + 1`` until ``until``.
    ``hold_at`` (worker id to generation): that worker's run waits forever once that
    generation's step is recorded (the test kills it)."""
    db = _side(params)
    gen = int(params["gen"])

    async def fn() -> int:
        row = {"task": ctx.key, "gen": gen, "run_id": ctx.run_id, "worker": ctx.worker_id}
        await db["step_rows"].insert_one(row)
        return gen

    await ctx.step("s", fn)
    if params.get("hold_at", {}).get(ctx.worker_id) == gen:
        await asyncio.sleep(3600)
    if gen < int(params["until"]):
        ctx.continue_as_new({**params, "gen": gen + 1})
    return gen


@registry.task("txn_step_chain")
async def txn_step_chain(params: dict[str, Any], ctx: TaskContext) -> list[dict[str, Any]]:
    """``count`` (4) transactional steps ``t1``, ``t2``, …; step i inserts ``{task, step: i,
    run_id}`` into ``txn_rows`` in its transaction, notes ``written`` in ``step_notes`` (outside
    it, majority-acknowledged), then waits ``slow_ms`` (300) before returning — or, for step
    ``block_in``, until a ``{_id: task}`` document is in ``step_control`` — and MongoDB commits
    the row with the step's record."""
    db_name = str(params["db"])
    block_in = params.get("block_in")
    results: list[dict[str, Any]] = []
    for i in range(1, int(params.get("count", 4)) + 1):

        async def book(i: int, *, session: Any) -> dict[str, Any]:
            db = session.client[db_name]
            row = {"task": ctx.key, "step": i, "run_id": ctx.run_id}
            await db["txn_rows"].insert_one(row, session=session)
            await _note(_side(params), {"task": ctx.key, "step": i, "event": "written"})
            if i == block_in:
                await _until_control(_side(params), ctx.key)
            else:
                await asyncio.sleep(params.get("slow_ms", 300) / 1000)
            return {"step": i}

        results.append(await ctx.step(f"t{i}", book, i, transactional=True))
    return results


async def _until_control(db: Any, key: str, limit_s: float = 120) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            if await db["step_control"].find_one({"_id": key}) is not None:
                return
        except PyMongoError:
            pass  # failing over: ask again
        await asyncio.sleep(0.05)
    raise RuntimeError(f"no control document for {key!r}")


@registry.task("step_showcase", options={"retry_delay_ms": 0, "max_retries": 3})
async def step_showcase(params: dict[str, Any], ctx: TaskContext) -> Any:
    """Every kind of durable step for the dashboard's step timeline: a plain one, one that fails
    once (its error holds markup), a 20 KB result (stored aside), a transactional one (a row
    in ``ledger`` of ``params["db"]``), a sleep, a wait that times out, and a wait for
    ``approved`` without a deadline, whose payload is the result."""

    def charge() -> str:
        if ctx.attempt == 1:
            raise RuntimeError("the gateway said <script>alert(1)</script>")
        return "ch_42"

    async def book(amount: int, *, session: Any) -> int:
        rows = session.client[str(params["db"])]["ledger"]
        await rows.insert_one({"task": ctx.key, "amount": amount}, session=session)
        return amount

    await ctx.step("reserve", dict, sku="A-1", n=2)
    await ctx.step("charge", charge)
    await ctx.step("label", str.__mul__, "x", 20_000)
    await ctx.step("book", book, 42, transactional=True)
    await ctx.sleep(0.05)
    with contextlib.suppress(SignalTimeout):
        await ctx.wait_for("nudge", timeout=0.05)
    return await ctx.wait_for("approved")


# -- a task explains itself (tests/acceptance/test_states_dashboard.py) -------------


@registry.task("await_approval")
async def await_approval(params: dict[str, Any], ctx: TaskContext) -> Any:
    """Charges, then waits for the signal ``approved`` and reads its payload's ``by`` (a
    signal without a payload makes it fail: the review's order-200)."""
    await ctx.step("charge", dict, order=params.get("order"))
    approval = await ctx.wait_for("approved", timeout=params.get("timeout"))
    return {"approved_by": approval["by"]}


@registry.task("nap")
async def nap(params: dict[str, Any], ctx: TaskContext) -> str:
    await ctx.sleep(float(params.get("seconds", 3600)))
    return "rested"


@registry.task("upstream_step", options={"retry_delay_ms": 0})
async def upstream_step(params: dict[str, Any], ctx: TaskContext) -> str:
    """A step that fails on the first ``fail_times`` attempts (its traceback mostly mtask's)."""

    def call_upstream() -> str:
        if ctx.attempt <= int(params.get("fail_times", 1)):
            raise RuntimeError("upstream 503")
        return "ok"

    return str(await ctx.step("call_upstream", call_upstream))
