"""Test helpers for users' handlers: run a handler on given params without MongoDB.

``run_handler(registry, name, params)`` does what a worker does with a claimed task, minus the
claim and the write: it parses the params against the handler's model, calls the handler (a
plain ``def`` on a thread of its own, as in the worker), and turns its return value or
exception into the ``Outcome`` the worker would record, through the very ``RunOutcomes`` the
worker uses (Oban's ``perform_job``, River's ``rivertest``)::

    outcome = run_handler(registry, "resize_image", {"url": "u", "width": 0})
    assert outcome.state is RunState.FAIL and outcome.permanent

An ``Outcome`` has ``state`` (``RunState.SUCCESS`` or ``RunState.FAIL``), ``result`` (what the
handler returned; for next steps, their keys), ``steps`` (the next steps, as the outbox entries
the worker publishes after the success), ``error`` (the message or traceback), ``permanent``
(False when the task would be retried) and ``retry_delay_ms`` (from ``Retry(delay=...)``).
``arun_handler`` is the same for a test that already runs an event loop.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from mtask.models import DEFAULT_MAX_PARAMS_BYTES
from mtask.registry import Registry, TaskContext
from mtask.store import Outcome
from mtask.worker.config import DEFAULT_MAX_RESULT_BYTES
from mtask.worker.events import Emitter
from mtask.worker.executor import RunOutcomes, WorkerStats
from mtask.worker.inflight import ActiveRun

__all__ = ["Outcome", "arun_handler", "run_handler", "worker_argv"]


async def arun_handler(
    registry: Registry,
    name: str,
    params: Mapping[str, Any] | None = None,
    *,
    key: str = "test-key",
    attempt: int = 1,
    worker_id: str = "test-worker",
    publisher: Callable[..., Awaitable[Any]] | None = None,
    max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES,
) -> Outcome:
    """Run ``registry``'s handler for ``name`` on ``params`` as run ``attempt`` of task
    ``key``, and return its outcome. ``publisher`` receives ``ctx.publish`` calls (without
    one, ``ctx.publish`` raises). Raises ``KeyError`` for a name with no handler."""
    handler = registry[name]
    run_id = f"{key}:test-run"
    ctx = TaskContext(
        key=key, name=name, attempt=attempt, run_id=run_id, worker_id=worker_id, publisher=publisher
    )
    run = ActiveRun(key=key, name=name, run_id=run_id, ctx=ctx)
    outcomes = RunOutcomes(WorkerStats(), Emitter(), max_result_bytes, DEFAULT_MAX_PARAMS_BYTES)
    return await outcomes.call(run, handler, {"params": dict(params or {})})


def run_handler(
    registry: Registry,
    name: str,
    params: Mapping[str, Any] | None = None,
    **options: Any,
) -> Outcome:
    """``arun_handler`` in an event loop of its own (from synchronous code)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(arun_handler(registry, name, params, **options))
    raise RuntimeError(
        "run_handler cannot be called from a running event loop: await arun_handler() instead"
    )


def worker_argv(registry: str, uri: str, database: str, *extra: str) -> list[str]:
    """The command line of a worker process for ``registry`` (``module:attribute``) with this
    interpreter: for integration tests and tools that start real workers (``extra``: more
    ``mtask worker run`` options; ``--log-level WARNING`` unless given)."""
    level = [] if "--log-level" in extra else ["--log-level", "WARNING"]
    return [sys.executable, "-m", "mtask", "worker", "run", registry, "--uri", uri,
            "--database", database, *level, *extra]  # fmt: skip
