"""Running a claimed task: the run's lifecycle (``Executor``) and its outcome (``RunOutcomes``).

``Executor.start`` turns a claimed document into a run in flight: a ``TaskContext``, a lease the
pinger extends, a local deadline, and the handler's asyncio task. When the handler ends, the
run leaves the in-flight ledger and its outcome goes to the outcome writer. A run whose lease
was lost (the pinger found another run owns the task, or its local deadline passed first) is
stopped and records nothing; a cancelled task's run records CANCELLED; a run stopped by the
worker's shutdown records RELEASED.

``RunOutcomes`` turns a handler's return value or exception into the outcome the worker records:
SUCCESS (with next steps, if it returned ``Next``), FAIL (retried, or permanent for ``Fail``,
invalid params, an unstorable result or an invalid step), RELEASED or CANCELLED for a run the
worker stopped, nothing for a run that lost its lease. How a handler is called (loop, thread,
child process; time limits) is ``mtask.worker.invoke``'s.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import random
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import bson

from mtask import flows, limits, metrics
from mtask.errors import ConfigError, InvalidParams, InvalidTask, LeaseLost
from mtask.models import DEFAULT_KEEP_MS, RunState
from mtask.output import RunOutput
from mtask.registry import Fail, Handler, Registry, Retry, TaskContext
from mtask.statemachine import keep_ms
from mtask.steps import MemorySteps, RunSteps, SignalTimeout, StepError, Suspended, Wait
from mtask.store import Outcome
from mtask.store.transactional import stale_sessions
from mtask.tracing import run_span
from mtask.worker.claim_queue import ClaimQueue
from mtask.worker.events import Emitter, Event
from mtask.worker.inflight import ActiveRun, InFlight
from mtask.worker.invoke import invoke
from mtask.worker.lease import LeasePinger
from mtask.worker.pool import (
    ChildDied,
    HandlerError,
    LeaseWatch,
    MemoryLimitExceeded,
    ProcessPool,
    TimeLimitExceeded,
    short_traceback,
)
from mtask.worker.recorder import OutcomeRecorder
from mtask.worker.transactional import RunFence, TransactionTooLong
from mtask.worker.wiring import Signal

log = logging.getLogger(__name__)


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
    waiting: int = 0


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
        slots: asyncio.Semaphore | None = None,
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
        self.slots = slots or asyncio.Semaphore(1_000_000)
        """A run waits here for a slot, which only a prefetched run (``WorkerConfig.prefetch``)
        has to do (``None``: no limit, outside a worker)."""

    async def call(self, run: ActiveRun, handler: Handler, doc: dict[str, Any]) -> Outcome:
        """Run the handler and say how the run ended (an exception is the task's failure)."""
        try:
            # the CONSUMER run span, child of the publisher's stored trace context (issue 14)
            async with self.slots:
                run.waiting = False
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
            delay = None if exc.delay is None else round(exc.delay * 1000)
            return self.failure(run, f"retry requested: {exc}", retry_delay_ms=delay)
        except Fail as exc:
            return self.failure(run, f"failed: {exc}", permanent=True)
        except LeaseLost as exc:
            if not handler.transactional:
                return self.failure(run, short_traceback(exc))
            return self.failure(
                run,
                "the run lost the task before its transaction committed; nothing it wrote landed",
            )
        except TransactionTooLong as exc:
            return self.failure(run, str(exc))
        except InvalidParams as exc:
            return self.failure(run, str(exc), permanent=True)
        except (HandlerError, ChildDied, TimeLimitExceeded, MemoryLimitExceeded) as exc:
            return self.failure(run, str(exc))  # issue 18; a memory kill: issue 27
        except Exception as exc:  # noqa: BLE001 - any handler error is the task's failure
            return self.failure(run, short_traceback(exc))

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
            size = len(bson.encode({"result": result}))
        except Exception as exc:  # noqa: BLE001 - any encoding problem is the handler's
            return self.failure(run, f"the result cannot be stored: {exc}", permanent=True)
        if size > self.max_result_bytes:
            return self.failure(
                run,
                f"the result is {size} bytes as BSON; the limit is {self.max_result_bytes}",
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

    def stopped(self, run: ActiveRun) -> Outcome | None:
        """A cancelled run's outcome: RELEASED, CANCELLED, or nothing (the lease was lost)."""
        reason = run.stop_reason
        if reason == "shutdown" or reason == "not_allowed":
            self.stats.released += 1
            self.emit(Event.RELEASED, key=run.key, run_id=run.run_id, reason=reason)
            return Outcome(run.key, run.run_id, RunState.RELEASED)
        if reason == "cancelled":
            self.stats.cancelled += 1
            self.emit(Event.CANCELLED, key=run.key, run_id=run.run_id)
            return Outcome(run.key, run.run_id, RunState.CANCELLED, error="cancelled")
        return None  # lost: another run owns the task; nothing may be written


def _spilled(run: ActiveRun, doc: Mapping[str, Any]) -> bool:
    """Whether the task holds step results stored aside (its outcome seals them)."""
    journal = run.ctx.steps_made
    if journal is not None:
        return journal.spilled or any("spill" in e for e in journal.recorded)
    steps = doc.get("steps")  # absent for a task that never used a step: nothing more to do
    return (
        bool(steps)
        and isinstance(steps, list)
        and any(isinstance(e, dict) and "spill" in e for e in steps)
    )


class _NotStored(Exception):
    """A transactional handler's result cannot be stored: abort, and fail the run."""

    def __init__(self, outcome: Outcome) -> None:
        super().__init__(outcome.error)
        self.outcome = outcome


class Executor:
    """Starts claimed runs and sees each to its end (River's job executor).

    Ownership: runs live in the ``InFlight`` ledger, written here on the event loop's thread;
    ``lost`` is called on the loop too (the pinger delivers it with ``call_soon_threadsafe``).
    """

    def __init__(
        self,
        *,
        registry: Registry,
        worker_id: str,
        publisher: Callable[..., Awaitable[Any]],
        inflight: InFlight,
        queue: ClaimQueue,
        pinger: LeasePinger,
        recorder: OutcomeRecorder,
        outcomes: RunOutcomes,
        wake: asyncio.Event,
        emit: Emitter,
        lost: Signal[[str, dict[str, Any] | None]],
    ) -> None:
        self.registry = registry
        self.worker_id = worker_id
        self.publisher = publisher
        self.inflight = inflight
        self.queue = queue
        self.pinger = pinger
        self.recorder = recorder
        self.outcomes = outcomes
        lost.connect(self.lost)  # the pinger found a run's task another's
        self.stats = outcomes.stats
        self.wake = wake
        """The claimer's wake-up: set when a run ends (a slot is free)."""
        self.emit = emit

    def start(self, doc: dict[str, Any], sent: float, slots: tuple[str, ...] = ()) -> None:
        """Run a claimed task: ``sent`` is when (monotonic) the claim that took it was sent,
        ``slots`` the limit slots the run holds (a name's, a group's, a sequence's lock)."""
        run_id = doc["claim_run_id"]
        options = doc["options"]
        loop = asyncio.get_running_loop()
        ctx = TaskContext(
            key=doc["_id"],
            name=doc["name"],
            attempt=doc["attempts"],
            run_id=run_id,
            worker_id=self.worker_id,
            publisher=self.publisher,
            output_for=functools.partial(
                self.outcomes.outputs.output_for,
                options=options,
                held=self.registry[doc["name"]].transactional,
                loop=loop,
            ),
            steps_for=lambda made: self.outcomes.journals.steps_for(
                made,
                doc=doc,
                transactional=self.registry[doc["name"]].transactional,
                fence=lambda: self.outcomes.fence(run, doc),
                loop=loop,
            ),
        )
        run = ActiveRun(
            key=doc["_id"],
            name=doc["name"],
            run_id=run_id,
            ctx=ctx,
            slots=slots,
            has_dependents=doc.get("has_dependents") is True,
        )
        self.inflight.started(run)
        self.queue.discard(run.key)
        self.pinger.add(
            run.key,
            run_id,
            options["ping_interval_ms"],
            options["worker_timeout_ms"],
            sent,
            slots=tuple(s for s in slots if not limits.is_claim_lock(s)),  # no document
        )
        run.task = asyncio.create_task(self.execute(run, doc), name=f"mtask-run-{run.key}")
        self.watch_deadline(run)
        metrics.by_name(metrics.CLAIMED, run.name).inc()
        metrics.IN_FLIGHT.inc()
        self.emit(Event.CLAIMED, key=run.key, run_id=run_id, attempt=ctx.attempt)

    async def execute(self, run: ActiveRun, doc: dict[str, Any]) -> None:
        run.begun = True
        outcome: Outcome | None
        try:
            if run.stop_reason is not None:  # stopped before its task took a step
                raise asyncio.CancelledError
            outcome = await self.outcomes.call(run, self.registry[run.name], doc)
            outcome = await self.output_done(run, outcome)
            if outcome is not None and _spilled(run, doc):
                outcome = dataclasses.replace(outcome, has_spills=True)
        except asyncio.CancelledError:
            outcome = self.outcomes.stopped(run)
            if outcome is None and run.stop_reason is None:
                raise
            outcome = await self.output_done(run, outcome)
        finally:
            metrics.IN_FLIGHT.dec()
            metrics.by_name(metrics.RUN_DURATION, run.name).observe(time.monotonic() - run.started)
            if run.deadline is not None:
                run.deadline.cancel()
            self.inflight.ended(run)
            self.pinger.remove(run.run_id)
            for slot in run.slots:  # given back by the outcome writer, after the outcome
                self.recorder.release_slot(slot, run.run_id)
            self.wake.set()
        if outcome is not None:
            self.recorder.add(outcome)

    async def output_done(self, run: ActiveRun, outcome: Outcome | None) -> Outcome | None:
        """Before the outcome is recorded: write what the run said last (nothing if it lost
        its task); an outcome of a run that stored lines or chunks seals them once recorded."""
        output = run.ctx.output_made
        if output is None:
            return outcome  # it said nothing: no cost
        stored = await self.outcomes.outputs.finish(output, write=outcome is not None)
        if outcome is not None and stored:
            return dataclasses.replace(outcome, has_output=True)
        return outcome

    def watch_deadline(self, run: ActiveRun) -> None:
        """Stop a run when its lease has run out by this process's own clock, before any
        other worker can take it over: after a freeze (SIGSTOP, a VM pause) the run is stopped
        by the first timer that fires, not by a ping answered later, and no ping success is
        assumed while MongoDB cannot be reached."""
        expiry = self.pinger.expiry(run.run_id)
        if expiry is None or run.task is None or run.task.done() or run.stop_reason:
            return
        loop = asyncio.get_running_loop()
        if loop.time() < expiry:
            run.deadline = loop.call_at(expiry, self.watch_deadline, run)
            return
        self.pinger.remove(run.run_id)
        log.warning(
            "the lease of %s run %s ran out before a ping could extend it (was the process "
            "frozen, or MongoDB out of reach?)",
            run.key,
            run.run_id[:8],
            extra={"key": run.key, "run_id": run.run_id},
        )
        self.lost(run.run_id, None)

    def lost(self, run_id: str, doc: dict[str, Any] | None) -> None:
        """The run no longer owns its task (the pinger found out, with the task's current
        status document, or the local deadline passed): stop its handler."""
        run = self.inflight.get(run_id)
        if run is None or run.task is None or run.stop_reason is not None:
            return  # gone, or already being stopped (the local deadline and a ping may race)
        still_running = doc is not None and any(
            r.get("run_id") == run_id and r.get("state") == "RUNNING" for r in doc.get("runs", ())
        )
        if doc is not None and doc.get("status") == "cancelled":
            run.stop_reason = "cancelled"
        elif still_running:
            run.stop_reason = "not_allowed"  # specific_worker_ids no longer names us
        else:
            run.stop_reason = "lost"
            run.ctx.lease_lost = True  # the handler's check_lease and publish raise LeaseLost
            self.stats.lease_lost += 1
            metrics.by_name(metrics.LEASE_LOST, run.name).inc()
            log.warning(
                "lease lost: %s run %s was taken over; its outcome will not be recorded",
                run.key,
                run_id[:8],
                extra={"key": run.key, "run_id": run_id},
            )
        self.stop(run, run.stop_reason)

    def stop(self, run: ActiveRun, reason: str) -> None:
        """Cancel a run's handler for ``reason`` (its outcome follows from the reason)."""
        run.stop_reason = reason
        if reason != "shutdown":
            self.emit(Event.STOPPING_RUN, key=run.key, run_id=run.run_id, reason=reason)
        run.ctx.cancelled.set()
        if run.task is not None and run.begun:  # else it sees stop_reason as it begins
            run.task.cancel()

    async def drain(self, grace: float, stop_now: asyncio.Event) -> None:
        """Wait up to ``grace`` seconds (or until ``stop_now``) for the runs in flight, then
        stop the rest for "shutdown" (they record RELEASED) and wait until they have ended."""
        for run in self.inflight.active():
            if run.waiting:  # claimed ahead and not started: give it back now (RELEASED)
                self.stop(run, "shutdown")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        immediate = asyncio.create_task(stop_now.wait())
        try:
            while not immediate.done():
                pending = [r.task for r in self.inflight.active() if r.task is not None]
                remaining = deadline - loop.time()
                if not pending or remaining <= 0:
                    break
                log.info(
                    "stopping: waiting up to %.1fs for %d run(s)",
                    remaining,
                    len(pending),
                    extra={"runs": len(pending)},
                )
                await asyncio.wait(
                    [*pending, immediate], timeout=remaining, return_when=asyncio.FIRST_COMPLETED
                )
        finally:
            immediate.cancel()
        for run in self.inflight.active():
            self.stop(run, "shutdown")
        stopping = [r.task for r in self.inflight.runs.values() if r.task is not None]
        if stopping:
            await asyncio.gather(*stopping, return_exceptions=True)
