"""How a handler is called, under its time limits: an ``async def`` on the worker's event loop,
a plain ``def`` on a thread of its own or, when isolated, in a child process of the pool.

Time limits are the handler's (``@registry.task(..., soft_time_limit=, time_limit=)``, seconds
from the start of the call). At the soft limit ``ctx.cancelled`` is set: a cooperative handler
stops and its return or exception is the run's outcome. At the hard limit the run ends with
``TimeLimitExceeded`` (recorded FAIL ``time limit exceeded``, which uses the retry budget):

- in a child process: the child is killed (SIGTERM, then SIGKILL, to its process group: what
  the handler started too) and replaced;
- ``async def``: its task is cancelled;
- plain ``def`` on a thread: Python cannot stop a thread. The run is recorded and the thread
  is abandoned; it runs on until the handler returns (``mtask_time_limit_kills{how="thread"}``
  counts them). Use ``isolation="process"`` for handlers that must be stoppable.

A run that holds a sequence's lock or limit slots (``held``) is never abandoned while it runs:
told to stop (its time limit, a cancel, the worker's stop), it waits for its handler to have
really stopped — its thread returned, its coroutine ended — before its outcome is recorded, so
its lock and slots stay held until then (docs/flow-control.md). ``Held`` says so (an event and
the ``mtask_runs_held`` gauge). A second cancel (the worker stopping for good) ends the wait:
the run is then left behind with its lease, which runs out.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, Literal, Protocol

from mtask import metrics
from mtask.registry import Handler, TaskContext
from mtask.steps import Suspended
from mtask.tracing import current_context
from mtask.worker.running.failures import class_path, short_traceback
from mtask.worker.running.pool.errors import HandlerError, TimeLimitExceeded

if TYPE_CHECKING:  # the process pool: imported by a worker that has one (assembly)
    from mtask.worker.running.pool.pool import LeaseWatch, ProcessPool

ASYNC_CANCEL_GRACE = 5.0
"""How long a cancelled async handler may take to unwind: past its time limit, before its run
is recorded anyway; at shutdown, before the worker stops without it (``Executor.drain``)."""


class Held(Protocol):
    """Told when a run's handler, told to stop, goes on (``began``) and when it has stopped
    (``ended``): the run holds its lock and slots meanwhile."""

    def began(self) -> None: ...

    def ended(self) -> None: ...


async def invoke(
    handler: Handler,
    params: Mapping[str, Any],
    ctx: TaskContext,
    *,
    pool: ProcessPool | None = None,
    isolation: Literal["thread", "process"] = "thread",
    thread_name: str = "mtask-run",
    lease: LeaseWatch | None = None,
    held: Held | None = None,
) -> Any:
    """Call ``handler`` for one run and return its result (or raise what it raised);
    ``lease`` lets a child process follow the run's lease (``ProcessPool.run``); ``held``: the
    run holds a lock or slots, and its handler is waited for when told to stop."""
    soft, hard = handler.soft_time_limit, handler.time_limit
    if not handler.is_async and pool is not None and (handler.isolation or isolation) == "process":
        from mtask.worker.running.pool.child_steps import ParentSteps  # with the pool alone
        from mtask.worker.running.pool.pipe import RunInfo

        trace = current_context()  # the run span's: the child's spans join it
        info = RunInfo(ctx.key, ctx.name, ctx.attempt, ctx.run_id, ctx.worker_id, trace)
        try:
            return await pool.run(
                handler,
                params,
                info,
                soft_timeout=soft,
                hard_timeout=hard,
                cancelled=ctx.cancelled,
                lease=lease,
                on_output=lambda batch: ctx.output.merge(batch),
                on_step=ParentSteps(ctx).answer,  # ctx.journal, made on the child's first ask
            )
        except TimeLimitExceeded:
            metrics.TIME_LIMIT_KILLS.labels(how="process").inc()
            raise
    args = handler.args(handler.parse(params), ctx)
    if handler.is_async:
        return await limited(handler.fn(*args), ctx, soft, hard, "async", held)
    thread = run_in_thread(handler.fn, *args, name=thread_name, held=held)
    return await limited(thread, ctx, soft, hard, "thread", held)


async def limited(
    call: Awaitable[Any],
    ctx: TaskContext,
    soft: float | None,
    hard: float | None,
    how: Literal["async", "thread"],
    held: Held | None = None,
) -> Any:
    """Await ``call`` under a soft limit (set ``ctx.cancelled``) and a hard one (cancel it:
    for a thread that abandons the thread, unless ``held``; raise ``TimeLimitExceeded``)."""
    if soft is None and hard is None:
        return await call
    task = asyncio.ensure_future(_contained(call))
    try:
        waited = 0.0
        if soft is not None and (hard is None or soft < hard):
            done, _ = await asyncio.wait({task}, timeout=soft)
            if done:
                return task.result()
            ctx.cancelled.set()
            waited = soft
        if hard is None:
            return await task
        done, _ = await asyncio.wait({task}, timeout=max(0.0, hard - waited))
        if done:
            return task.result()
    except asyncio.CancelledError:  # the run is stopped (a cancel, the worker's stop)
        task.cancel()
        if held is not None:  # it keeps its lock and slots until its handler has stopped
            await _stopped(task, held, announce=how == "async")
        else:  # it ends when its handler does, as an await of the handler itself would: a
            await _ended(task)  # drain sees one that swallows its cancel, and abandons it
        raise
    ctx.cancelled.set()
    task.cancel()
    if how == "async" or held is not None:
        # a thread's run says it is held itself (``run_in_thread``), an async one here
        await _stopped(task, held, announce=how == "async")
    metrics.TIME_LIMIT_KILLS.labels(how=how).inc()
    detail = ""
    if how == "thread":
        detail = (
            "; the handler's thread could not be stopped: the run held its lock and slots "
            "until it returned"
            if held is not None
            else "; the handler's thread could not be stopped and runs on"
        )
    raise TimeLimitExceeded(f"time limit exceeded ({hard:g} s){detail}")


async def _stopped(task: asyncio.Future[Any], held: Held | None, announce: bool) -> None:
    """After a cancel at the time limit: wait ``ASYNC_CANCEL_GRACE`` for ``task`` to end; a run
    that holds a lock or slots waits on, as long as it takes, and says so if ``announce``."""
    done, _ = await asyncio.wait({task}, timeout=ASYNC_CANCEL_GRACE)
    if not done and held is not None:
        if announce:
            held.began()
        try:
            await asyncio.wait({task})
        finally:
            if announce:
                held.ended()
    if task.done() and not task.cancelled():
        task.exception()  # seen: what it ended with is not the run's outcome any more


async def _ended(task: asyncio.Future[Any]) -> None:
    """Wait for a cancelled handler's ``task`` to end, passing on any further cancel of the
    run to it: the run records nothing (RELEASED at a stop) while its handler still runs."""
    while not task.done():
        try:
            await asyncio.wait({task})
        except asyncio.CancelledError:
            task.cancel()
    if not task.cancelled():
        task.exception()  # seen: what it ended with is not the run's outcome any more


async def _contained(call: Awaitable[Any]) -> Any:
    """Await a handler's call in a task of its own: what it raises that is not an
    ``Exception`` (``SystemExit``: ``sys.exit()``, argparse's error) is raised as a
    ``HandlerError`` holding its traceback, the run's failure, as the run's own task records it
    (``RunOutcomes``): asyncio hands a task's ``SystemExit`` or ``KeyboardInterrupt`` on to the
    event loop, which would end the worker."""
    try:
        return await call
    except (Exception, asyncio.CancelledError, Suspended):
        raise
    except BaseException as exc:  # the handler's: its run's failure
        raise HandlerError(short_traceback(exc), class_path(exc)) from exc


async def run_in_thread(
    fn: Callable[..., Any], *args: Any, name: str, held: Held | None = None
) -> Any:
    """Run a plain-def handler on a thread of its own. Cancelling the await abandons the
    thread (Python cannot stop one): a handler that hangs forever then costs a thread, never a
    slot of the worker, as it would in a fixed-size pool. With ``held`` (the run holds a lock
    or slots) a cancel waits for the thread to return first, then is raised; a second cancel
    ends that wait."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    # The thread takes the call out of this list and lets go of it before it tells the loop:
    # the thread object holds `target` until the thread has ended, and a closure over `args`
    # would keep the run's context alive after the run ended, until then.
    work: list[Any] = [fn, args]

    def target() -> None:
        call, arguments = work
        work.clear()
        error: BaseException | None
        try:
            result, error = call(*arguments), None
        except asyncio.CancelledError as exc:  # the handler's own: the awaiting task would
            # take it for its stop
            result, error = None, HandlerError(short_traceback(exc), class_path(exc))
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting task
            result, error = None, exc
        del call, arguments
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody awaits any more
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=target, name=name, daemon=True).start()
    if held is None:
        return await future
    return await _held_thread(future, held)


async def _held_thread(future: asyncio.Future[Any], held: Held) -> Any:
    """The thread's result; cancelled, wait for the thread to return first (a second cancel
    ends that wait), saying so, then raise the cancel."""
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        if not future.done():
            held.began()
            try:
                await asyncio.wait({future})  # the thread's return; a second cancel ends this
            finally:
                held.ended()
        if not future.cancelled():
            future.exception()  # seen
        raise
