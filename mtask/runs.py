"""A run in a worker, and how its handler's end becomes an ``Outcome``.

``RunOutcomes`` turns a handler's return value or exception into the outcome the worker records:
SUCCESS (with next steps, if it returned ``Next``), FAIL (retried, or permanent for ``Fail``,
invalid params, an unstorable result or an invalid step), RELEASED or CANCELLED for a run the
worker stopped, nothing for a run that lost its lease. Plain-def handlers run on a thread each.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import os
import random
import socket
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import bson

from mtask import flows, metrics
from mtask.errors import InvalidTask
from mtask.models import RunState
from mtask.registry import Fail, Handler, InvalidParams, Retry, TaskContext
from mtask.store import Outcome
from mtask.tracing import span

TRACEBACK_LIMIT = 4000


@dataclass
class WorkerStats:
    claim_calls: int = 0
    claim_attempts: int = 0
    """Keys tried in claims (for the stampede measure: attempts per claimed task)."""
    claimed: int = 0
    succeeded: int = 0
    failed: int = 0
    retried: int = 0
    lease_lost: int = 0
    released: int = 0
    cancelled: int = 0


@dataclass
class ActiveRun:
    key: str
    name: str
    run_id: str
    ctx: TaskContext
    slot: str | None = None
    """The name whose cluster-wide limit gave this run a slot (given back when it ends)."""
    has_dependents: bool = False
    task: asyncio.Task[None] | None = None
    stop_reason: str | None = None
    deadline: asyncio.TimerHandle | None = None
    """The timer of ``Worker._watch_deadline``; cancelled when the run ends (it holds the run)."""
    started: float = field(default_factory=time.monotonic)


def default_worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


def short_traceback(exc: BaseException) -> str:
    text = "".join(traceback.format_exception(exc))
    return text if len(text) <= TRACEBACK_LIMIT else "…" + text[-TRACEBACK_LIMIT:]


class RunOutcomes:
    def __init__(
        self,
        stats: WorkerStats,
        emit: Callable[..., None],
        max_result_bytes: int,
        max_params_bytes: int,
    ) -> None:
        self.stats = stats
        self.emit = emit
        self.max_result_bytes = max_result_bytes
        self.max_params_bytes = max_params_bytes

    async def call(self, run: ActiveRun, handler: Handler, doc: dict[str, Any]) -> Outcome:
        """Run the handler and say how the run ended (an exception is the task's failure)."""
        try:
            params = handler.parse(doc.get("params") or {})
            args = handler.args(params, run.ctx)
            with span("mtask.run", name=run.name, key=run.key, attempt=run.ctx.attempt):
                if handler.is_async:
                    result = await handler.fn(*args)
                else:
                    result = await run_in_thread(handler.fn, *args, name=f"mtask-run-{run.key}")
            return self.success(run, result)
        except Retry as exc:
            delay = None if exc.delay is None else round(exc.delay * 1000)
            return self.failure(run, f"retry requested: {exc}", retry_delay_ms=delay)
        except Fail as exc:
            return self.failure(run, f"failed: {exc}", permanent=True)
        except InvalidParams as exc:
            return self.failure(run, str(exc), permanent=True)
        except Exception as exc:  # noqa: BLE001 - any handler error is the task's failure
            return self.failure(run, short_traceback(exc))

    def success(self, run: ActiveRun, result: Any) -> Outcome:
        steps: tuple[dict[str, Any], ...] = ()
        if flows.is_steps(result):
            try:
                built = flows.build_steps(run.key, result, self.max_params_bytes)
            except InvalidTask as exc:
                return self.failure(run, f"invalid next step: {exc}", permanent=True)
            steps = tuple(flows.outbox_entry(t) for t in built)
            result = [t.key for t in built]
        try:
            size = len(bson.encode({"result": result}))
        except Exception as exc:  # noqa: BLE001 - any encoding problem is the handler's
            return self.failure(run, f"the result cannot be stored: {exc}", permanent=True)
        if size > self.max_result_bytes:
            return self.failure(
                run,
                f"the result is {size} bytes as BSON; the limit is {self.max_result_bytes}",
                permanent=True,
            )
        self.stats.succeeded += 1
        metrics.by_name(metrics.SUCCEEDED, run.name).inc()
        self.emit("succeeded", key=run.key, run_id=run.run_id)
        return Outcome(
            run.key,
            run.run_id,
            RunState.SUCCESS,
            result=result,
            steps=steps,
            has_dependents=run.has_dependents,
            worker_id=run.ctx.worker_id,
            result_bytes=size,
        )

    def failure(
        self,
        run: ActiveRun,
        error: str,
        *,
        permanent: bool = False,
        retry_delay_ms: int | None = None,
    ) -> Outcome:
        metrics.by_name(metrics.FAILED, run.name).inc()
        if permanent:
            self.stats.failed += 1
        else:
            self.stats.retried += 1
            metrics.by_name(metrics.RETRIED, run.name).inc()
        self.emit(
            "failed",
            key=run.key,
            run_id=run.run_id,
            error=(error.strip().splitlines() or [""])[-1],
            permanent=permanent,
        )
        return Outcome(
            run.key,
            run.run_id,
            RunState.FAIL,
            error=error,
            permanent=permanent,
            retry_delay_ms=retry_delay_ms,
            jitter=random.uniform(0.8, 1.2),
            has_dependents=run.has_dependents,
        )

    def stopped(self, run: ActiveRun) -> Outcome | None:
        """A cancelled run's outcome: RELEASED, CANCELLED, or nothing (the lease was lost)."""
        reason = run.stop_reason
        if reason == "shutdown" or reason == "not_allowed":
            self.stats.released += 1
            self.emit("released", key=run.key, run_id=run.run_id, reason=reason)
            return Outcome(run.key, run.run_id, RunState.RELEASED)
        if reason == "cancelled":
            self.stats.cancelled += 1
            self.emit("cancelled", key=run.key, run_id=run.run_id)
            return Outcome(run.key, run.run_id, RunState.CANCELLED, error="cancelled")
        return None  # lost: another run owns the task; nothing may be written


async def run_in_thread(fn: Callable[..., Any], *args: Any, name: str) -> Any:
    """Run a plain-def handler on a thread of its own. Cancelling the await abandons the
    thread (Python cannot stop one): a handler that hangs forever then costs a thread, never a
    slot of the worker, as it would in a fixed-size pool."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def target() -> None:
        try:
            result, error = fn(*args), None
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting task
            result, error = None, exc
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody awaits any more
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=target, name=name, daemon=True).start()
    return await future


def dt_seconds(seconds: float) -> dt.timedelta:
    return dt.timedelta(seconds=seconds)
