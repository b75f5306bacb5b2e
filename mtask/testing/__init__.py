"""Test helpers for users' handlers: run a handler on given params without MongoDB.

``run_handler(registry, name, params)`` does what a worker does with a claimed task, minus the
claim and the write: it parses the params against the handler's model, calls the handler (a
plain ``def`` on a thread of its own, as in the worker), and turns its return value or
exception into the ``Outcome`` the worker would record, through the very ``HandlerCalls`` and
``RunOutcomes`` the worker uses (Oban's ``perform_job``, River's ``rivertest``)::

    outcome = run_handler(registry, "resize_image", {"url": "u", "width": 0})
    assert outcome.state is RunState.FAIL and outcome.permanent

An ``Outcome`` has ``state`` (``RunState.SUCCESS`` or ``RunState.FAIL``), ``result`` (what the
handler returned; for next steps, their keys), ``steps`` (the next steps, as the outbox entries
the worker publishes after the success), ``error`` (the message or traceback), ``permanent``
(False when the task would be retried) and ``retry_delay_ms`` (from ``Retry(delay=...)``).
``arun_handler`` is the same for a test that already runs an event loop.

A ``transactional=True`` handler (docs/transactions.md) runs in a real MongoDB transaction, as
in a worker: give ``mongo_client`` (a ``pymongo.AsyncMongoClient`` to a replica set; for
``run_handler``, a URI). Its writes through ``ctx.session`` commit together once it returns
(the task's own SUCCESS, which a worker writes in the same transaction, is left out: there is
no task document), and none lands when it raises. Without one, ``arun_handler`` raises
``ConfigError`` naming the handler.

``TimeSkippingEnv`` (``mtask.testing.timeskip``) runs workers and a client against an embedded
MongoDB whose clock ``skip`` moves forward: a workflow that sleeps for a month runs in seconds.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from pymongo import AsyncMongoClient
from pymongo.asynchronous.client_session import AsyncClientSession
from pymongo.read_concern import ReadConcern
from pymongo.write_concern import WriteConcern

from mtask.connection.clients import WORKER_CLIENT_OPTIONS, async_client
from mtask.errors import ConfigError
from mtask.follow.output import RunOutput
from mtask.registry import Registry, TaskContext
from mtask.steps import MemorySteps, RunSteps
from mtask.store import Outcome
from mtask.testing.timeskip import TimeSkippingEnv, find_libfaketime
from mtask.usage.charges import MemoryUsage, RunUsage
from mtask.vocabulary import DEFAULT_MAX_PARAMS_BYTES
from mtask.worker.config import DEFAULT_MAX_RESULT_BYTES
from mtask.worker.inflight import ActiveRun
from mtask.worker.running.call import HandlerCalls, NoTransactions
from mtask.worker.running.context import NoLeases, NoOutputs
from mtask.worker.running.outcomes import RunOutcomes
from mtask.worker.running.transactional import RunFence, TransactionEnded
from mtask.worker.stats import WorkerStats
from mtask.worker.worker_events import Emitter

__all__ = [
    "MemorySteps",
    "Outcome",
    "TimeSkippingEnv",
    "arun_handler",
    "find_libfaketime",
    "run_handler",
    "worker_argv",
]


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
    mongo_client: AsyncMongoClient[dict[str, Any]] | None = None,
    output: RunOutput | None = None,
    steps: MemorySteps | None = None,
) -> Outcome:
    """Run ``registry``'s handler for ``name`` on ``params`` as run ``attempt`` of task
    ``key``, and return its outcome. ``publisher`` receives ``ctx.publish`` calls (without
    one, ``ctx.publish`` raises); ``mongo_client`` runs a transactional handler's transaction;
    ``output`` receives what the handler reports (``ctx.progress``/``log``/``emit``: read it with
    ``mtask.follow.output.RecordedOutput.of(output)``); ``steps`` holds the task's durable steps and
    signals between calls (docs/steps.md): a run that sleeps or waits returns a WAITING outcome
    and its step is recorded there, so calling again (after ``steps.signal(...)``, or with a
    ``clock`` past the sleep) resumes it and replays what is recorded. Raises ``KeyError`` for
    a name with no handler."""
    handler = registry[name]
    if handler.transactional and mongo_client is None:
        raise ConfigError(
            f"{name!r} is a transactional handler: give arun_handler a mongo_client (a "
            "replica set) to run its transaction in"
        )
    run_id = f"{key}:test-run:{attempt}"
    journal = MemorySteps() if steps is None else steps
    loop = asyncio.get_running_loop()
    ctx = TaskContext(
        key=key,
        name=name,
        attempt=attempt,
        run_id=run_id,
        worker_id=worker_id,
        publisher=publisher,
        output_for=(lambda _ctx: RunOutput()) if output is None else (lambda _ctx: output),
        steps_for=lambda made, gate: RunSteps(
            journal,
            journal.recorded,
            run_id=run_id,
            attempt=attempt,
            loop=loop,
            release=made.release,  # what a step says is written once it is recorded
            gate=gate,
        ),
        # usage priced from the registry's table, kept in memory (``ctx.usage.recorded``)
        usage_for=lambda _ctx: RunUsage(MemoryUsage(), prices=registry.prices, loop=loop),
    )
    run = ActiveRun(key=key, name=name, run_id=run_id, ctx=ctx)
    transactions = NoTransactions() if mongo_client is None else _Transactions(mongo_client)
    outcomes = RunOutcomes(WorkerStats(), Emitter(), max_result_bytes, DEFAULT_MAX_PARAMS_BYTES)
    calls = HandlerCalls(
        outcomes, transactions=transactions, leases=NoLeases(), outputs=NoOutputs()
    )
    outcome = await calls.call(run, handler, {"params": dict(params or {})})
    if outcome.wait is not None and outcome.wait.entry is not None:  # as the worker records it
        await journal.record(outcome.wait.index, dict(outcome.wait.entry), None)
    return outcome


class _Transactions:
    """A transactional handler's transaction, without a task: its writes commit together."""

    def __init__(self, mongo: AsyncMongoClient[dict[str, Any]]) -> None:
        self.mongo = mongo

    async def complete(
        self,
        handler: Callable[[Any], Awaitable[Any]],
        outcome_for: Callable[[Any], Outcome],
        fence: RunFence | None = None,
    ) -> tuple[Any, dict[str, Any]]:
        async def body(session: AsyncClientSession) -> Any:
            result = await handler(session)
            if not session.in_transaction:  # as in a worker
                raise TransactionEnded()
            outcome_for(result)  # a result that cannot be stored aborts, as in a worker
            return result

        async with self.mongo.start_session() as session:
            result = await session.with_transaction(
                body, read_concern=ReadConcern("snapshot"), write_concern=WriteConcern("majority")
            )
        return result, {}


def run_handler(
    registry: Registry,
    name: str,
    params: Mapping[str, Any] | None = None,
    *,
    mongo_uri: str | None = None,
    **options: Any,
) -> Outcome:
    """``arun_handler`` in an event loop of its own (from synchronous code); ``mongo_uri``
    (a replica set) runs a transactional handler's transaction."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(_run_with_uri(registry, name, params, mongo_uri, options))
    raise RuntimeError(
        "run_handler cannot be called from a running event loop: await arun_handler() instead"
    )


async def _run_with_uri(
    registry: Registry,
    name: str,
    params: Mapping[str, Any] | None,
    mongo_uri: str | None,
    options: dict[str, Any],
) -> Outcome:
    if mongo_uri is None:
        return await arun_handler(registry, name, params, **options)
    client = async_client(mongo_uri, defaults=WORKER_CLIENT_OPTIONS)  # a worker's codec too
    try:
        return await arun_handler(registry, name, params, mongo_client=client, **options)
    finally:
        await client.close()


def worker_argv(registry: str, uri: str, database: str, *extra: str) -> list[str]:
    """The command line of a worker process for ``registry`` (``module:attribute``) with this
    interpreter: for integration tests and tools that start real workers (``extra``: more
    ``mtask worker run`` options; ``--log-level WARNING`` unless given)."""
    level = [] if "--log-level" in extra else ["--log-level", "WARNING"]
    return [sys.executable, "-m", "mtask", "worker", "run", registry, "--uri", uri,
            "--database", database, *level, *extra]  # fmt: skip
