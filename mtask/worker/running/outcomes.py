"""A run's outcome (``RunOutcomes``): a handler's return value or exception turned into what the
worker records, and the collaborators that shape a run's call, each behind a protocol with a
form that does nothing (``NoTransactions``, ``NoLeases``, ``NoOutputs``, ``NoJournals``: what
``mtask.testing.run_handler`` passes).

SUCCESS (with next steps, if the handler returned ``Next``), FAIL (retried, or permanent for
``Fail``, invalid params, an unstorable result or an invalid step), RELEASED or CANCELLED for a
run the worker stopped, nothing for a run that lost its lease. How a handler is called (loop,
thread, child process; time limits) is ``mtask.worker.running.invoke``'s; the run's lifecycle around
the call is ``mtask.worker.running.executor``'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import random
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Literal, Protocol

import bson

from mtask import flows, metrics
from mtask.errors import ConfigError, InvalidParams, InvalidTask, LeaseLost
from mtask.models import DEFAULT_KEEP_MS, MAX_STORED_DEPTH, RunState, storable_depth
from mtask.output import RunOutput
from mtask.registry import Fail, Handler, Retry, TaskContext, retry_delay_ms
from mtask.statemachine import keep_ms
from mtask.steps import MemorySteps, RunSteps, SignalTimeout, StepError, Suspended, Wait
from mtask.store import Outcome
from mtask.store.transactional import stale_sessions
from mtask.tracing import run_span
from mtask.worker.events import Emitter, Event
from mtask.worker.inflight import ActiveRun
from mtask.worker.running.failures import result_too_large, said, short_traceback
from mtask.worker.running.invoke import invoke
from mtask.worker.running.pool.errors import (
    ChildDied,
    HandlerError,
    MemoryLimitExceeded,
    ReplyRefused,
    TimeLimitExceeded,
)
from mtask.worker.running.pool.pool import LeaseWatch, ProcessPool
from mtask.worker.running.slots import GiveBack
from mtask.worker.running.transactional import RunFence, TransactionEnded, TransactionTooLong
from mtask.worker.stats import WorkerStats


class TransactionRunner(Protocol):
    """How a transactional handler's writes and its run's SUCCESS commit together
    (``transactional.Transactions`` in a worker)."""

    async def complete(
        self,
        handler: Callable[[Any], Awaitable[Any]],
        outcome_for: Callable[[Any], Outcome],
        fence: RunFence | None = None,
    ) -> tuple[Any, dict[str, Any]]: ...


class RunLeases(Protocol):
    """The leases of the runs in flight, as a run sees them (``LeasePinger`` in a worker)."""

    def watch(self, run_id: str, on_expiry: Callable[[float], None]) -> Callable[[], None]: ...

    def pause(self, run_id: str) -> None: ...

    def held(self, run_id: str, sent: float) -> float | None: ...

    def resume(self, run_id: str) -> None: ...


class RunOutputs(Protocol):
    """Where the runs' live output goes (``output_writer.OutputWriter`` in a worker)."""

    def output_for(
        self,
        ctx: TaskContext,
        *,
        options: Mapping[str, Any],
        held: bool,
        loop: asyncio.AbstractEventLoop,
    ) -> RunOutput: ...

    async def finish(self, output: RunOutput, *, write: bool) -> bool: ...

    async def write_in(self, output: RunOutput, session: Any) -> None: ...

    def restart(self, output: RunOutput) -> None: ...


class NoOutputs:
    """For ``RunOutcomes`` outside a worker: a run's output stays in its buffer, where a test
    reads it (``mtask.output.RecordedOutput``)."""

    def output_for(
        self,
        ctx: TaskContext,
        *,
        options: Mapping[str, Any],
        held: bool,
        loop: asyncio.AbstractEventLoop,
    ) -> RunOutput:
        return RunOutput()

    async def finish(self, output: RunOutput, *, write: bool) -> bool:
        return False

    async def write_in(self, output: RunOutput, session: Any) -> None:
        pass

    def restart(self, output: RunOutput) -> None:
        output.discard()


class RunJournals(Protocol):
    """Where the runs' durable steps are recorded (``worker.steps.RunStepStores``)."""

    def steps_for(
        self,
        ctx: TaskContext,
        *,
        doc: Mapping[str, Any],
        transactional: bool,
        fence: Callable[[], RunFence],
        loop: asyncio.AbstractEventLoop,
    ) -> RunSteps: ...


class NoJournals:
    """For ``RunOutcomes`` outside a worker: steps are recorded in memory."""

    def steps_for(
        self,
        ctx: TaskContext,
        *,
        doc: Mapping[str, Any],
        transactional: bool,
        fence: Callable[[], RunFence],
        loop: asyncio.AbstractEventLoop,
    ) -> RunSteps:
        return RunSteps(MemorySteps(), doc.get("steps"), run_id=ctx.run_id, attempt=ctx.attempt)


class NoTransactions:
    """For ``RunOutcomes`` without MongoDB: a transactional handler cannot run there."""

    async def complete(
        self,
        handler: Callable[[Any], Awaitable[Any]],
        outcome_for: Callable[[Any], Outcome],
        fence: RunFence | None = None,
    ) -> tuple[Any, dict[str, Any]]:
        raise ConfigError("a transactional handler needs MongoDB to run its transaction in")


class NoLeases:
    """For ``RunOutcomes`` outside a worker: nothing pings, nothing expires."""

    def watch(self, run_id: str, on_expiry: Callable[[float], None]) -> Callable[[], None]:
        return lambda: None

    def pause(self, run_id: str) -> None:
        pass

    def held(self, run_id: str, sent: float) -> float | None:
        return None

    def resume(self, run_id: str) -> None:
        pass


NO_RESULT_BYTES = len(bson.encode({"result": None}))
"""A handler that returns nothing stores this much."""


class RunOutcomes:
    def __init__(
        self,
        stats: WorkerStats,
        emit: Emitter,
        max_result_bytes: int,
        max_params_bytes: int,
        *,
        transactions: TransactionRunner,
        leases: RunLeases,
        outputs: RunOutputs,
        journals: RunJournals,
        pool: ProcessPool | None = None,
        isolation: Literal["thread", "process"] = "thread",
        slots: contextlib.AbstractAsyncContextManager[Any] | None = None,
    ) -> None:
        self.stats = stats
        self.emit = emit
        self.max_result_bytes = max_result_bytes
        self.max_params_bytes = max_params_bytes
        self.transactions = transactions
        """How transactional handlers open their transactions."""
        self.outputs = outputs
        """Where ``ctx.progress``/``log``/``emit`` go: written under the run's fence; a
        transactional run's in its transaction."""
        self.journals = journals
        """Where ``ctx.step``/``sleep``/``wait_for`` record (docs/steps.md)."""
        self.leases = leases
        """A transactional run pauses its pings while its transaction is open; a
        process-isolated run's child follows its lease's renewals."""
        self.pool = pool
        """Child processes for process-isolated plain-def handlers (issue 18)."""
        self.isolation = isolation
        """The worker-wide default for plain-def handlers that do not declare one."""
        self.slots = slots or contextlib.nullcontext()
        """A run waits here for a slot, which only a run claimed ahead (``WorkerConfig.prefetch``,
        ``claim_ahead.RunSlots``) has to do; ``GiveBack`` from it records the run RELEASED
        (``None``: this worker never claims ahead, so no run waits)."""

    async def call(self, run: ActiveRun, handler: Handler, doc: dict[str, Any]) -> Outcome:
        """Take a slot (only a run claimed ahead may wait for one), run the handler in it, and
        say how the run ended."""
        try:
            async with self.slots:
                run.waiting = False
                run.running_since = time.monotonic()
                return await self._run(run, handler, doc)
        except GiveBack:  # claimed ahead, it waited too long for its slot (claim_ahead.py)
            return self.given_back(run)

    async def _run(self, run: ActiveRun, handler: Handler, doc: dict[str, Any]) -> Outcome:
        """Run the handler and say how the run ended (an exception is the task's failure)."""
        try:
            # the CONSUMER run span, child of the publisher's stored trace context (issue 14)
            with run_span(doc, run.name, run.key, run.ctx.attempt):
                if handler.transactional:
                    params = handler.parse(doc.get("params") or {})
                    return await self._transactional(run, handler, params, doc)
                result = await invoke(
                    handler,
                    doc.get("params") or {},
                    run.ctx,
                    pool=self.pool,
                    isolation=self.isolation,
                    thread_name=f"mtask-run-{run.key}",
                    lease=self._lease_watch(run),
                )
            # issue 17: the retention the plain SUCCESS updates write
            return self.success(run, result, keep_ms(doc.get("options") or {}, "succeeded"))
        except Suspended as suspended:
            return self.waiting(run, suspended.wait)
        except (StepError, SignalTimeout) as exc:  # the same on every replay: no retry
            return self.failure(run, f"{type(exc).__name__}: {exc}", permanent=True)
        except Retry as exc:
            return self._retried(run, exc)
        except Fail as exc:
            return self.failure(run, f"failed: {said(exc)}", permanent=True)
        except LeaseLost as exc:
            if not handler.transactional:
                return self.failure(run, short_traceback(exc))
            return self.failure(
                run,
                "the run lost the task before its transaction committed; nothing it wrote landed",
            )
        except (InvalidParams, TransactionEnded, ReplyRefused) as exc:  # the same on every run
            return self.failure(run, str(exc), permanent=True)
        except (
            TransactionTooLong,
            HandlerError,  # issue 18
            ChildDied,
            TimeLimitExceeded,
            MemoryLimitExceeded,  # issue 27
        ) as exc:
            return self.failure(run, str(exc))
        except asyncio.CancelledError:
            raise  # the run is stopped: its outcome follows from why (``stopped``)
        except BaseException as exc:  # noqa: BLE001 - any handler error is the task's failure:
            # sys.exit() (argparse's error) or a class of its own too; up in its task, asyncio
            # hands a SystemExit or KeyboardInterrupt to the event loop (the worker's end), any
            # other would end the task with no outcome (its task RUNNING until its lease ran out)
            return self.failure(run, short_traceback(exc))

    def _retried(self, run: ActiveRun, exc: Retry) -> Outcome:
        """A ``Retry``: a failure with its delay, checked again (a subclass or a changed
        ``delay`` skips the constructor's check); a delay out of range gets the backoff."""
        try:
            delay = retry_delay_ms(getattr(exc, "delay", None))
        except ValueError as bad:
            return self.failure(run, f"retry requested: {said(exc)} ({bad})")
        return self.failure(run, f"retry requested: {said(exc)}", retry_delay_ms=delay)

    def _lease_watch(self, run: ActiveRun) -> LeaseWatch | None:
        """How a process-isolated run's child follows the run's lease (renewals from the
        pinger), so it can stop itself if the worker stops renewing (a frozen worker)."""
        return functools.partial(self.leases.watch, run.run_id)

    async def _transactional(
        self, run: ActiveRun, handler: Handler, params: Any, doc: dict[str, Any]
    ) -> Outcome:
        """The handler and the run's SUCCESS in one transaction; the SUCCESS outcome returned is
        ``committed`` (the recorder does not write it again). A result that cannot be stored
        aborts the transaction and is the run's FAIL. The transactions of earlier runs of the
        task whose lease expired are killed first (``RunFence``)."""

        async def invoke(session: Any) -> Any:
            run.ctx.session = session
            held = run.ctx.output_made
            if held is not None:  # a body run again: the aborted one's output is gone
                self.outputs.restart(held)
            try:
                result = await handler.fn(params, run.ctx)
                said = run.ctx.output_made
                if said is not None:  # commits with the SUCCESS, or not at all
                    await self.outputs.write_in(said, session)
                return result
            finally:
                run.ctx.session = None

        built: list[Outcome] = []  # the last is the one committed (a body may run again)

        def outcome_for(result: Any) -> Outcome:
            keep = keep_ms(doc.get("options") or {}, "succeeded")
            outcome = self.success(run, result, keep, count=False)  # counted once committed
            if outcome.state is not RunState.SUCCESS:
                raise _NotStored(outcome)
            built.append(outcome)
            return outcome

        try:
            await self.transactions.complete(invoke, outcome_for, self.fence(run, doc))
        except _NotStored as refused:
            return refused.outcome
        self.succeeded(run)
        return dataclasses.replace(built[-1], committed=True)

    def fence(self, run: ActiveRun, doc: Mapping[str, Any]) -> RunFence:
        """What a run's transaction adds (a transactional handler's, or a step's)."""
        pinger = self.leases
        return RunFence(
            run.key,
            run.run_id,
            run.ctx.worker_id,
            tuple(stale_sessions(doc.get("runs"), run.run_id)),
            alive=lambda: run.stop_reason is None and not run.ctx.cancelled.is_set(),
            pause=lambda: pinger.pause(run.run_id),
            held=lambda sent: pinger.held(run.run_id, sent),
            resume=lambda: pinger.resume(run.run_id),
        )

    def waiting(self, run: ActiveRun, wait: Wait) -> Outcome:
        """A run that ends sleeping or waiting for a signal (docs/steps.md)."""
        self.stats.waiting += 1
        self.emit(
            Event.WAITING,
            key=run.key,
            run_id=run.run_id,
            until=wait.until.isoformat(),
            signal=wait.signal,
        )
        return Outcome(run.key, run.run_id, RunState.WAITING, wait=wait)

    def success(
        self,
        run: ActiveRun,
        result: Any,
        keep: int | None = DEFAULT_KEEP_MS["succeeded"],
        *,
        count: bool = True,
    ) -> Outcome:
        """The SUCCESS outcome of ``result`` (a FAIL if it cannot be stored), kept ``keep`` ms
        once finished; ``count``: count it and emit ``succeeded`` now (a transactional run
        does once its transaction commits: ``succeeded``)."""
        steps: tuple[dict[str, Any], ...] = ()
        if flows.is_steps(result):
            try:
                built = flows.build_steps(run.key, result, self.max_params_bytes)
            except InvalidTask as exc:
                return self.failure(run, f"invalid next step: {exc}", permanent=True)
            steps = tuple(flows.outbox_entry(t) for t in built)
            result = [t.key for t in built]
        try:
            size = NO_RESULT_BYTES if result is None else len(bson.encode({"result": result}))
        except Exception as exc:  # noqa: BLE001 - any encoding problem is the handler's
            return self.failure(run, f"the result cannot be stored: {exc}", permanent=True)
        if size > self.max_result_bytes:
            return self.failure(run, result_too_large(size, self.max_result_bytes), permanent=True)
        if not storable_depth(result, size):  # MongoDB would refuse the outcome's update
            return self.failure(
                run,
                f"the result cannot be stored: it is nested more than {MAX_STORED_DEPTH} levels "
                "deep",
                permanent=True,
            )
        if count:
            self.succeeded(run)
        return Outcome(
            run.key,
            run.run_id,
            RunState.SUCCESS,
            result=result,
            steps=steps,
            has_dependents=run.has_dependents,
            worker_id=run.ctx.worker_id,
            result_bytes=size,
            keep_ms=keep,
        )

    def succeeded(self, run: ActiveRun) -> None:
        self.stats.succeeded += 1
        metrics.by_name(metrics.SUCCEEDED, run.name).inc()
        self.emit(Event.SUCCEEDED, key=run.key, run_id=run.run_id)

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
            Event.FAILED,
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

    def given_back(self, run: ActiveRun) -> Outcome:
        """A run claimed ahead that waited too long for its slot: RELEASED, never started (no
        retry spent; any worker may claim its task at once)."""
        self.stats.released += 1
        self.emit(Event.RELEASED, key=run.key, run_id=run.run_id, reason="slot_wait")
        return Outcome(run.key, run.run_id, RunState.RELEASED)

    def stopped(self, run: ActiveRun) -> Outcome | None:
        """A cancelled run's outcome: RELEASED, CANCELLED, or nothing (the lease was lost)."""
        reason = run.stop_reason
        if reason in ("shutdown", "not_allowed", "slot_lost"):
            self.stats.released += 1
            self.emit(Event.RELEASED, key=run.key, run_id=run.run_id, reason=reason)
            return Outcome(run.key, run.run_id, RunState.RELEASED)
        if reason == "cancelled":
            self.stats.cancelled += 1
            self.emit(Event.CANCELLED, key=run.key, run_id=run.run_id)
            return Outcome(run.key, run.run_id, RunState.CANCELLED, error="cancelled")
        return None  # lost: another run owns the task; nothing may be written


class _NotStored(Exception):
    """A transactional handler's result cannot be stored: abort, and fail the run."""

    def __init__(self, outcome: Outcome) -> None:
        super().__init__(outcome.error)
        self.outcome = outcome
