"""A worker inside the test's event loop, its events collected for the test to await."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import AsyncIterator
from typing import Any

from mtask.registry import Registry
from mtask.worker import Worker

from .events import Events
from .processes import STOP_WITHIN


@contextlib.asynccontextmanager
async def running_worker(
    registry: Registry, uri: str, database: str, *, crash_expected: bool = False, **kwargs: Any
) -> AsyncIterator[tuple[Worker, Events]]:
    """A worker in the test's loop, stopped at the end. A worker that crashed (its ``run``
    raised) or did not stop within ``STOP_WITHIN`` fails the test that passed otherwise, unless
    the test says it expects a crash (``crash_expected``)."""
    events = Events()
    kwargs.setdefault("heartbeat_interval", 0.2)
    worker = Worker(registry, uri=uri, database=database, on_event=events, **kwargs)
    task = asyncio.create_task(worker.run())
    try:
        await asyncio.wait_for(_ready(worker, task), 30)
        yield worker, events
    except BaseException as exc:
        worker.stop(immediate=True)
        with contextlib.suppress(Exception, asyncio.CancelledError):
            await asyncio.wait_for(task, STOP_WITHIN)
        if task.done() and not task.cancelled() and task.exception() is not None:
            # the test failed on what a crashed worker left undone: say the crash too
            exc.add_note(f"the worker had crashed: {task.exception()!r}")
        raise
    worker.stop(immediate=True)
    await _verdict(task, crash_expected)


async def _verdict(task: asyncio.Task[None], crash_expected: bool) -> None:
    try:
        await asyncio.wait_for(task, STOP_WITHIN)
    except TimeoutError:
        raise AssertionError(f"the worker did not stop within {STOP_WITHIN} s (a hang)") from None
    except Exception as exc:
        if not crash_expected:
            raise AssertionError(f"the worker crashed: {exc!r}") from exc
        return
    if crash_expected:
        raise AssertionError("the test expected the worker to crash, and it stopped cleanly")


async def _ready(worker: Worker, task: asyncio.Task[None]) -> None:
    while not worker.parts.finding.finder.ready.is_set():
        if task.done():
            task.result()
        await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def until_recorded(
    registry: Registry,
    publish: Any,
    key: str,
    *,
    uri: str,
    database: str,
    state: str | None = None,
    **kwargs: Any,
) -> AsyncIterator[tuple[Worker, Events]]:
    """``running_worker`` (``kwargs``: its options) once ``publish`` (an awaitable, or a
    callable, called and its result awaited if it is one) published ``key`` and the worker
    recorded a run of it (in ``state``, if given): publish, then drain. The ``worker_after``
    fixture binds ``uri`` and ``database`` to the test's."""
    async with running_worker(registry, uri, database, **kwargs) as (worker, events):
        published = publish() if callable(publish) else publish
        if inspect.isawaitable(published):
            await published
        match = {} if state is None else {"state": state}
        await events.wait("recorded", key=key, **match)
        yield worker, events


async def drained(*args: Any, **kwargs: Any) -> Events:
    """``until_recorded`` (its arguments), and the worker stopped: what it reported. The
    ``drain`` fixture binds ``uri`` and ``database`` to the test's."""
    async with until_recorded(*args, **kwargs) as (_, events):
        return events
