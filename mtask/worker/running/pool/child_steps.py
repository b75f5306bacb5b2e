"""Durable steps in a child process of the pool (docs/steps.md): ``ctx.step_sync``,
``sleep_sync``, ``wait_for_sync`` and ``wait_until_sync`` in a process-isolated handler work as
on a thread.

The child's journal is a ``RunSteps`` like any run's; its ``StepStore`` is ``PipeSteps``, which
asks the worker for each write and read over the child's pipe (a ``pipe.StepAsk``, sent under
the run's lock like the child's output) and blocks for its ``pipe.StepAnswer``: a value, or an
exception raised in the child as itself (``LeaseLost``, ``StepError``, a ``StorageError``). The
worker answers with the run's own ``StepStore`` (``ParentSteps``: the parent's ``ctx.journal``,
made on the first request, so a run of a task that cannot have steps fails there, as on a
thread). The first request, ``JOURNAL``, brings the steps the claimed document recorded;
``NOW`` is the worker's estimate of the server's clock. Nothing is asked of the worker by a run
that takes no step.

The run's usage (docs/usage.md) is the worker's too: ``ctx.record_usage`` in the child is a
``pipe.StepAsk`` (``USAGE``) that the worker records with the run's own ``RunUsage`` (priced,
fenced by the run, counted in its metrics and its windows of tokens), and the gate before each
step (``GATE``) checks the budgets and windows of tokens there (``PipeUsage``).

How the run ends travels back as itself too: ``Suspended`` (with its ``Wait``) ends the run
WAITING; ``StepError``, ``StepMismatch`` and ``SignalTimeout`` fail it for good (``pipe.Reply``).
"""

from __future__ import annotations

import multiprocessing.connection
import pickle
import threading
from collections.abc import Mapping
from typing import Any, Protocol

import bson
from bson.codec_options import CodecOptions

from mtask.errors import LeaseLost, MtaskError
from mtask.registry import TaskContext
from mtask.steps import Doc, Journal, RunSteps, StepError
from mtask.steps import complete_now as complete
from mtask.steps.calls import Gate
from mtask.tracing import step_tracer
from mtask.usage.charges import MemoryUsage, RunUsage
from mtask.usage.rules import Usage
from mtask.worker.running.pool import pipe
from mtask.worker.running.pool.pipe import StepAsk, StepOp

# -- the child side -------------------------------------------------------------------------------


AWARE: CodecOptions[Any] = CodecOptions(tz_aware=True)


def plain(value: Any) -> Any:
    """``value`` as BSON gives it back: how a value that BSON stores but pickle refuses (a
    ``defaultdict`` with a lambda: any mapping is a document to BSON) crosses the pipe. Raises
    what BSON raises for a value it cannot store."""
    return bson.decode(bson.encode({"v": value}), codec_options=AWARE)["v"]


class _RunLock(Protocol):
    lock: threading.Lock
    active: bool


class ChildSteps:
    """One run's requests to the worker, one at a time (the reply to each is read before the
    next is sent); after ``close`` (the handler returned) a thread it left behind gets
    ``LeaseLost``, as it does once the lease watch ended the run."""

    def __init__(self, conn: multiprocessing.connection.Connection, run: _RunLock) -> None:
        self.conn, self.run = conn, run
        self._lock = threading.Lock()
        self._closed = False

    def ask(self, op: StepOp, *args: Any) -> Any:
        with self._lock:
            with self.run.lock:  # never between the bytes of another send (the output's)
                if self._closed or not self.run.active:
                    raise LeaseLost("the run has ended: its steps cannot be recorded")
                try:
                    pipe.send(self.conn, StepAsk(op, args))  # pickled whole before it is written
                except OSError:
                    raise
                except Exception:  # noqa: BLE001 - a step's result pickle refuses, BSON takes
                    pipe.send(self.conn, StepAsk(op, plain(list(args))))
            try:
                answer = pipe.answer(self.conn)
            except (EOFError, OSError):
                raise LeaseLost("the worker is gone: the run's steps cannot be recorded") from None
        return answer.result()

    def steps_for(self, ctx: TaskContext, gate: Gate) -> RunSteps:
        recorded = self.ask(StepOp.JOURNAL)
        return RunSteps(
            PipeSteps(self),
            recorded,
            run_id=ctx.run_id,
            attempt=ctx.attempt,
            blocking_io=complete,
            release=ctx.release,
            # each step's span, under the worker's run span (``RunInfo.trace``), where this
            # process has a tracer provider (the application's module set one)
            spans=step_tracer({}, ctx.name, ctx.key, ctx.attempt, ctx.run_id),
            gate=gate,
        )

    def usage_for(self, _ctx: TaskContext) -> RunUsage:
        return PipeUsage(self)

    def close(self) -> None:
        """The run's reply is next: no request may come between (waits for one in flight)."""
        with self._lock:
            self._closed = True


class PipeSteps:
    """The child's ``StepStore``: each call is a request to the worker (``ParentSteps``). Its
    async methods never await; ``complete`` runs them (``RunSteps(blocking_io=)``)."""

    def __init__(self, steps: ChildSteps) -> None:
        self.steps = steps

    def now(self) -> Any:
        return self.steps.ask(StepOp.NOW)

    async def record(self, index: int, entry: Doc, prior: Doc | None) -> None:
        self.steps.ask(StepOp.RECORD, index, entry, prior)

    async def spill(self, data: bytes) -> Doc:
        ref: Doc = self.steps.ask(StepOp.SPILL, data)
        return ref

    async def load(self, spill: Mapping[str, Any]) -> bytes:
        data: bytes = self.steps.ask(StepOp.LOAD, dict(spill))
        return data

    async def signals(self, name: str) -> list[Doc]:
        came: list[Doc] = self.steps.ask(StepOp.SIGNALS, name)
        return came

    async def holds(self, collection: str, predicate: Doc, waiting: Doc | None) -> Doc | None:
        found: Doc | None = self.steps.ask(StepOp.HOLDS, collection, predicate, waiting)
        return found

    async def transact(self, *args: Any, **kw: Any) -> Any:
        raise StepError("transactional steps need an async def handler")

    async def record_named(self, entry: Doc, prior: Doc | None) -> None:
        self.steps.ask(StepOp.RECORD_NAMED, entry, prior)

    async def spawn(self, index: int, entry: Doc, children: list[Doc]) -> None:
        self.steps.ask(StepOp.SPAWN, index, entry, children)

    async def publish(self, step: str, children: list[Doc]) -> None:
        self.steps.ask(StepOp.PUBLISH, step, children)

    async def children(self, step: str) -> list[Doc]:
        found: list[Doc] = self.steps.ask(StepOp.CHILDREN, step)
        return found


COUNTS = ("input_tokens", "output_tokens", "cached_tokens", "requests")


class PipeUsage(RunUsage):
    """The child's ``RunUsage``: each charge and each step's check is a request to the worker,
    which keeps the run's usage (``ParentSteps``). Its async methods never await."""

    def __init__(self, steps: ChildSteps) -> None:
        super().__init__(MemoryUsage())
        self.steps = steps

    async def record_said(
        self, model: str | None, counts: Mapping[str, Any], replaying: bool
    ) -> Usage:
        return self.record_said_sync(model, counts, replaying)

    def record_said_sync(
        self, model: str | None, counts: Mapping[str, Any], replaying: bool
    ) -> Usage:
        usage: Usage = self.steps.ask(StepOp.USAGE, model, dict(counts), replaying)
        if not replaying:
            self.recorded.append(usage)
        return usage

    async def record(self, usage: Usage) -> Usage:
        return self.record_sync(usage)

    def record_sync(self, usage: Usage) -> Usage:
        counts = {k: getattr(usage, k) for k in COUNTS}
        return self.record_said_sync(usage.model, {**counts, "cost": usage.cost}, False)

    async def check(self) -> None:
        self.steps.ask(StepOp.GATE)


# -- the worker side ------------------------------------------------------------------------------


class ParentSteps:
    """Answers a child's requests with the run's ``StepStore`` (the parent's ``ctx.journal``,
    whose ``recorded`` and ``spilled`` follow what the child writes: the run's outcome seals
    what it stored aside)."""

    def __init__(self, ctx: TaskContext) -> None:
        self.ctx = ctx

    async def answer(self, op: StepOp, args: tuple[Any, ...]) -> Any:
        if op == StepOp.USAGE:  # as ctx.record_usage on a thread (a run may take no step)
            model, counts, replaying = args
            self.ctx.check_lease()
            return await self.ctx.usage.record_said(model, counts, replaying)
        if op == StepOp.GATE:  # BudgetSpent or Snooze raised in the child as itself
            return await self.ctx.usage.check()
        journal = self.ctx.journal.journal  # made on the first request; may refuse (StepError)
        store = journal.store
        if op == StepOp.JOURNAL:
            return [dict(e) for e in journal.recorded]
        if op == StepOp.NOW:
            return store.now()
        if op == StepOp.RECORD:
            index, entry, prior = args
            await store.record(index, entry, prior)
            journal.keep(index, entry)
            return None
        if op == StepOp.SPILL:
            ref = await store.spill(args[0])
            journal.spilled = True
            return ref
        if op == StepOp.LOAD:
            return await store.load(args[0])
        if op == StepOp.SIGNALS:
            return await store.signals(args[0])
        if op == StepOp.HOLDS:
            return await store.holds(*args)
        return await self._more(journal, op, args)

    async def _more(self, journal: Journal, op: StepOp, args: tuple[Any, ...]) -> Any:
        """The workflow's requests: a parallel step's record, a spawn, its children."""
        store = journal.store
        if op == StepOp.RECORD_NAMED:
            entry, prior = args
            await store.record_named(entry, prior)
            journal.keep_named(entry)
            return None
        if op == StepOp.SPAWN:
            index, entry, children = args
            await store.spawn(index, entry, children)
            journal.keep(index, entry)
            return None
        if op == StepOp.PUBLISH:
            return await store.publish(*args)
        if op == StepOp.CHILDREN:
            return await store.children(args[0])
        raise StepError(f"no such step request: {op!r}")


def sendable(exc: BaseException) -> BaseException:
    """``exc`` if it pickles (and comes back as itself), else an ``MtaskError`` saying it."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:  # noqa: BLE001 - any exception may fail to pickle
        return MtaskError(f"{type(exc).__name__}: {exc}")
    return exc
