"""How a plan (``mtask.steps.plan``) is run: ``Runner.run_async`` on the worker's loop (an
``async def`` handler), ``Runner.run_sync`` on a thread or in a child process (a plain ``def``
handler), its I/O then done on the loop, or by ``blocking_io`` (``complete_now``: a store whose
methods never await). A step's function runs with what it says held
(``mtask.follow.output.holding``) and, under a time limit, as ``mtask.steps.tries`` gives it up."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from mtask.follow.output import holding
from mtask.steps.plan import IN_STEP, Invoke, Io, Pause, Plan
from mtask.steps.rules import StepError
from mtask.steps.tries import timed_async, timed_sync

T = TypeVar("T")


class Runner:
    """Runs plans: ``loop`` is the worker's event loop, where a thread handler's I/O runs;
    ``blocking_io`` how a plain-def handler's I/O runs instead (default: on ``loop``, waited
    for)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop | None = None,
        blocking_io: Callable[[Coroutine[Any, Any, Any]], Any] | None = None,
    ) -> None:
        self.loop = loop
        self.blocking_io = blocking_io

    async def run_async(self, plan: Plan[T]) -> T:
        value: Any = None
        error: BaseException | None = None
        while True:
            need, done = _advance(plan, value, error)
            if done:
                return need  # type: ignore[no-any-return]
            value, error = None, None
            try:
                if isinstance(need, Io):
                    value = await need.make()
                elif isinstance(need, Pause):
                    await asyncio.sleep(need.seconds)
                else:
                    value = await call_async(need)
            except BaseException as exc:
                if isinstance(exc, asyncio.CancelledError):
                    plan.close()
                    raise
                error = exc

    def run_sync(self, plan: Plan[T]) -> T:
        value: Any = None
        error: BaseException | None = None
        while True:
            need, done = _advance(plan, value, error)
            if done:
                return need  # type: ignore[no-any-return]
            value, error = None, None
            try:
                if isinstance(need, Io):
                    value = self.blocking(need.make())
                elif isinstance(need, Pause):
                    time.sleep(need.seconds)
                else:
                    value = call_sync(need)
            except BaseException as exc:  # noqa: BLE001 - given back to the plan
                error = exc

    def blocking(self, coro: Coroutine[Any, Any, Any]) -> Any:
        if self.blocking_io is not None:
            return self.blocking_io(coro)
        if self.loop is None:
            return asyncio.run(coro)
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop:
            coro.close()
            raise StepError("in an async def handler, await ctx.step/sleep/wait_for")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()


def _advance(plan: Plan[Any], value: Any, error: BaseException | None) -> tuple[Any, bool]:
    """The plan resumed with ``value`` (or ``error`` thrown in): ``(its next need, False)``,
    or ``(its result, True)`` once it returned. One step of both runners' loops."""
    try:
        return (plan.throw(error) if error is not None else plan.send(value)), False
    except StopIteration as stop:
        return stop.value, True


async def call_async(call: Invoke) -> Any:
    """A step's function called on the loop (in a thread when it has a time limit), with what
    it says held (``Invoke.said``)."""
    token = IN_STEP.set(call.step)
    try:
        with holding(call.said):
            if call.timeout is not None:
                return await timed_async(call, call.timeout)
            value = call.fn()
            if inspect.isawaitable(value):
                value = await value
            return value
    finally:
        IN_STEP.reset(token)


def call_sync(call: Invoke) -> Any:
    token = IN_STEP.set(call.step)
    try:
        with holding(call.said):
            value = call.fn() if call.timeout is None else timed_sync(call, call.timeout)
        if inspect.isawaitable(value):
            close = getattr(value, "close", None)
            if callable(close):
                close()
            raise StepError(
                "step_sync calls plain functions; await ctx.step(...) in an async def handler "
                "for a coroutine function"
            )
        return value
    finally:
        IN_STEP.reset(token)


def complete_now(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run a coroutine that never suspends (a ``StepStore`` whose methods do no I/O on a loop:
    a child process's pipe, a dry replay's record) to its end, here."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    coro.close()
    raise StepError("a step's I/O here cannot await")
