"""A call step's own policy (``mtask.steps.policy``), spent in place: its function tried again
after a backoff (``Pause``), each try noted in its entry; and each try given up past its time
limit (``StepTimeout``), on the loop or on a thread."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import inspect
import threading
import time
from collections.abc import Callable
from typing import Any

from mtask.steps.journal import Journal
from mtask.steps.plan import Invoke, Pause, Plan
from mtask.steps.policy import StepPolicy, StepTimeout
from mtask.steps.rules import Doc, error_text


def tries(
    journal: Journal,
    entry: Doc,
    call: Callable[[], Any],
    policy: StepPolicy,
    said: list[Any] | None,
) -> Plan[Any]:
    """Call the step's function until it returns, at most ``policy.retries`` more times
    after a failure, waiting its backoff in place; each try is noted in ``entry``. The
    last failure is raised with ``entry`` marked ``failed``; a success marks it ``done``."""
    failed = 0
    while True:
        started = time.monotonic()
        try:
            result = yield Invoke(call, entry["name"], policy.timeout, said)
        except Exception as exc:
            ms = round((time.monotonic() - started) * 1000)
            journal.tried(entry, journal.store.now(), ms, error_text(exc))
            failed += 1
            if failed > policy.retries:
                entry.update(state="failed", error=error_text(exc))
                raise
            yield from _backoff(journal, entry["name"], policy.delay(failed), failed)
            continue
        ms = round((time.monotonic() - started) * 1000)
        entry["state"] = "done"
        journal.tried(entry, journal.store.now(), ms)
        return result


async def timed_async(call: Invoke, seconds: float) -> Any:
    """The function in a thread (an ``async def``'s coroutine on the loop), given up after
    ``seconds``: ``StepTimeout`` (a plain function's thread cannot be stopped: it is left to
    end on its own, and its result is dropped)."""
    limit = asyncio.timeout(seconds)
    try:
        async with limit:
            value = await asyncio.to_thread(call.fn)
            if inspect.isawaitable(value):
                value = await value
            return value
    except TimeoutError:
        if limit.expired():
            raise StepTimeout(f"step {call.step!r} took more than {seconds:g} s") from None
        raise


def timed_sync(call: Invoke, seconds: float) -> Any:
    """``timed_async`` for a plain-def handler: the function on a thread of its own (a daemon:
    one that never ends does not hold the process)."""
    future: concurrent.futures.Future[Any] = concurrent.futures.Future()
    context = contextvars.copy_context()

    def body() -> None:
        try:
            future.set_result(context.run(call.fn))
        except BaseException as exc:  # noqa: BLE001 - given to the waiting step
            future.set_exception(exc)

    threading.Thread(target=body, name=f"mtask-step-{call.step}", daemon=True).start()
    try:
        return future.result(seconds)
    except TimeoutError:
        if future.done():
            raise
        raise StepTimeout(f"step {call.step!r} took more than {seconds:g} s") from None


def _backoff(journal: Journal, step: str, seconds: float, failed: int) -> Plan[None]:
    """The wait in place between two tries, in a ``backoff`` span where there is a tracer."""
    if journal.spans is None:
        yield Pause(seconds)
        return
    opened = journal.spans.part("backoff", step=step, delay_s=seconds, tries=failed)
    error: BaseException | None = None
    try:
        yield Pause(seconds)
    except BaseException as exc:
        error = exc
        raise
    finally:
        opened.close(error)
