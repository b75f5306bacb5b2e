"""Parallel durable steps: ``await ctx.gather(ctx.step("a", …), ctx.step("b", …))``.

The steps of one gather run concurrently: each is recorded under its own name as it ends (in
whatever order they end), and a later run of the task matches them by name, in any order
(``mtask.steps.Group``): a run killed after two of three ended calls only the third again. A
gather is one place in the task's order: the steps before it are recorded before it begins,
the steps after it once all of it ended. The first step that fails (or a sleep or wait that
ends the run) ends the gather: the others are cancelled (a thread's function is left to end,
its result dropped) and what failed is raised, as the handler would see it from one step.

``gather_sync`` is the same for a plain-def handler: each argument is a function of no
arguments (``lambda: ctx.step_sync("a", …)``), run on a thread of its own. The names of a
gather's steps are unique in the task, as every step's; one asked again from the same place (a
loop, a comprehension) is numbered as anywhere (``fetch``, ``fetch#2``, …).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from mtask.steps import CURRENT, Group, RunSteps, StepError
from mtask.steps.spans import StepSpans

T = TypeVar("T")
MAX_BRANCHES = 1000


async def gather(
    journal: RunSteps, branches: Sequence[Awaitable[Any]], name: str | None
) -> list[Any]:
    """Run ``branches`` (awaitables, usually ``ctx.step`` coroutines) as one group of the
    journal; their results in the order given."""
    _check(branches)
    await journal.run_plan(journal.flush())  # what was decided before comes before it
    group = journal.open_group(name)
    spans = journal.journal.spans
    opened = spans.part("gather", gather=group.label) if spans is not None else None
    completed = False
    error: BaseException | None = None
    try:
        token = CURRENT.set(group)
        try:  # each task copies the context now: its steps are the group's
            tasks = [
                asyncio.ensure_future(b if spans is None else _branch(spans, group, i, b))
                for i, b in enumerate(branches)
            ]
        finally:
            CURRENT.reset(token)
        results = await _first_error(tasks)
        completed = True
        return results
    except BaseException as exc:
        error = exc
        raise
    finally:
        if opened is not None:
            opened.close(error)
        journal.close_group(group, completed)


async def _branch(spans: StepSpans, group: Group, index: int, branch: Awaitable[T]) -> T:
    """A gather's branch, in a ``branch`` span (where there is a tracer)."""
    opened = spans.part("branch", gather=group.label, branch=index)
    try:
        value = await branch
    except BaseException as exc:
        opened.close(exc)
        raise
    opened.close()
    return value


async def _first_error(tasks: Sequence[asyncio.Future[Any]]) -> list[Any]:
    """Every task's result, in order; at the first that raises, the others are cancelled and
    awaited, and that exception raised. A cancelled gather cancels them all."""
    try:
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    except asyncio.CancelledError:
        await _cancel(tasks)
        raise
    errors = [t.exception() for t in tasks if t in done and not t.cancelled()]  # all seen
    failed = next((e for e in errors if e is not None), None)
    if failed is None:
        return [t.result() for t in tasks]
    await _cancel(list(pending))
    raise failed


async def _cancel(tasks: Sequence[asyncio.Future[Any]]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def gather_sync(
    journal: RunSteps, branches: Sequence[Callable[[], Any]], name: str | None
) -> list[Any]:
    """``gather`` for a plain-def handler: each branch (a function of no arguments) on a thread
    of its own; the first exception is raised once every branch ended (a thread cannot be
    cancelled)."""
    _check(branches)
    if not all(callable(b) for b in branches):
        raise StepError(
            "gather_sync takes functions of no arguments: lambda: ctx.step_sync(name, fn, ...)"
        )
    journal.run_plan_sync(journal.flush())
    group = journal.open_group(name)
    spans = journal.journal.spans
    opened = spans.part("gather", gather=group.label) if spans is not None else None
    completed = False
    error: BaseException | None = None
    try:
        results = _threads(spans, group, branches)
        completed = True
        return results
    except BaseException as exc:
        error = exc
        raise
    finally:
        if opened is not None:
            opened.close(error)
        journal.close_group(group, completed)


def _branch_sync(spans: StepSpans, group: Group, index: int, branch: Callable[[], T]) -> T:
    opened = spans.part("branch", gather=group.label, branch=index)
    try:
        value = branch()
    except BaseException as exc:
        opened.close(exc)
        raise
    opened.close()
    return value


def _threads(
    spans: StepSpans | None, group: Group, branches: Sequence[Callable[[], Any]]
) -> list[Any]:
    token = CURRENT.set(group)
    try:
        contexts = [contextvars.copy_context() for _ in branches]
    finally:
        CURRENT.reset(token)
    with concurrent.futures.ThreadPoolExecutor(len(branches), "mtask-branch") as pool:
        futures = [
            pool.submit(c.run, b)
            if spans is None
            else pool.submit(c.run, _branch_sync, spans, group, i, b)
            for i, (c, b) in enumerate(zip(contexts, branches, strict=True))
        ]
        concurrent.futures.wait(futures)
    for future in futures:
        error = future.exception()
        if error is not None:
            raise error
    return [f.result() for f in futures]


def _check(branches: Sequence[Any]) -> None:
    if not 1 <= len(branches) <= MAX_BRANCHES:
        for branch in branches:  # a coroutine never awaited would warn
            close = getattr(branch, "close", None)
            if callable(close):
                close()
        raise StepError(f"a gather has from 1 to {MAX_BRANCHES} branches, not {len(branches)}")
