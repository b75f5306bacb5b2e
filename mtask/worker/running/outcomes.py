"""A run's outcome (``RunOutcomes``): what a handler returned or raised, turned into the
``Outcome`` the worker records; nothing else.

SUCCESS (with next steps, if the handler returned ``Next``), FAIL (retried, or permanent for
``Fail``, invalid params, an unstorable result or an invalid step), WAITING for a run that
sleeps or waits for a signal, CONTINUED for one that continues as new, SNOOZED for a
``Snooze``, RELEASED or CANCELLED for a run the worker stopped, nothing for a run that lost its
lease. Each is counted
(``WorkerStats``, metrics) and told (``Emitter``) here, once. How the handler is called (its
slot, its transaction, a thread or a child process) and what the call itself may fail with (a
child that died, a time limit) is ``mtask.worker.running.call``'s; the run's lifecycle around it is
``mtask.worker.running.executor``'s.
"""

from __future__ import annotations

import random
from typing import Any

import bson

from mtask import flows, metrics
from mtask.errors import InvalidParams, InvalidTask
from mtask.limits.snooze import Snooze, snooze_delay_ms
from mtask.registry import Fail, Retry, retry_delay_ms
from mtask.security.encryption import UNOPENED
from mtask.steps import SignalTimeout, StepError, Suspended, Wait
from mtask.steps.children import ChildFailed
from mtask.store import Outcome
from mtask.vocabulary import DEFAULT_KEEP_MS, MAX_STORED_DEPTH, RunState, storable_depth
from mtask.worker.inflight import ActiveRun
from mtask.worker.running.failures import class_path, result_too_large, said, short_traceback
from mtask.worker.stats import WorkerStats
from mtask.worker.worker_events import Emitter, Event

NO_RESULT_BYTES = len(bson.encode({"result": None}))
"""A handler that returns nothing stores this much."""


class RunOutcomes:
    """What a run ends with: ``success`` of what its handler returned, ``raised`` of what it
    raised; ``stopped`` or ``given_back`` for a run the worker ended."""

    def __init__(
        self, stats: WorkerStats, emit: Emitter, max_result_bytes: int, max_params_bytes: int
    ) -> None:
        self.stats = stats
        self.emit = emit
        self.max_result_bytes = max_result_bytes
        self.max_params_bytes = max_params_bytes
        """Each next step a handler returns is checked as a publish would check it."""

    def raised(self, run: ActiveRun, exc: BaseException) -> Outcome:
        """The outcome of a handler that raised ``exc`` (never ``CancelledError``: a stopped
        run's outcome follows from why it was stopped, ``stopped``)."""
        if isinstance(exc, Suspended):
            if exc.wait.renew is not None:
                return self.continued(run, exc.wait.renew)
            return self.waiting(run, exc.wait)
        kind = class_path(exc)  # recorded with a FAIL (``Run.error_class``)
        if isinstance(exc, StepError | SignalTimeout | ChildFailed):  # the same on every replay
            text = f"{type(exc).__name__}: {exc}"
            return self.failure(run, text, permanent=True, error_class=kind)
        if isinstance(exc, Retry):
            return self._retried(run, exc, kind)
        if isinstance(exc, Snooze):
            return self.snoozed(run, exc)
        if isinstance(exc, Fail):
            return self.failure(run, f"failed: {said(exc)}", permanent=True, error_class=kind)
        if isinstance(exc, InvalidParams):  # the same on every run
            return self.failure(run, str(exc), permanent=True, error_class=kind)
        # any other error is the task's failure: sys.exit() (argparse's error), LeaseLost, or
        # a class of its own too
        return self.failure(run, short_traceback(exc), error_class=kind)

    def _retried(self, run: ActiveRun, exc: Retry, kind: str) -> Outcome:
        """A ``Retry``: a failure with its delay, checked again (a subclass or a changed
        ``delay`` skips the constructor's check); a delay out of range gets the backoff."""
        try:
            delay = retry_delay_ms(getattr(exc, "delay", None))
        except ValueError as bad:
            return self.failure(run, f"retry requested: {said(exc)} ({bad})", error_class=kind)
        text = f"retry requested: {said(exc)}"
        return self.failure(run, text, retry_delay_ms=delay, error_class=kind)

    def snoozed(self, run: ActiveRun, exc: Snooze) -> Outcome:
        """A ``Snooze``: SNOOZED, claimable again after its seconds, no retry spent;
        its delay checked again (a subclass or a changed ``delay_ms`` skips the constructor's
        check): one out of range is the task's failure, as a bad ``Retry`` delay is."""
        try:
            delay = snooze_delay_ms(exc.seconds)
        except (AttributeError, TypeError, ValueError) as bad:
            return self.failure(run, f"snooze requested: {said(exc)} ({bad})")
        self.stats.snoozed += 1
        metrics.by_name(metrics.SNOOZED, run.name).inc()
        self.emit(Event.SNOOZED, key=run.key, run_id=run.run_id, seconds=delay / 1000)
        return Outcome(run.key, run.run_id, RunState.SNOOZED, error=said(exc), retry_delay_ms=delay)

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

    def continued(self, run: ActiveRun, renew: dict[str, Any]) -> Outcome:
        """A run that continues as new (``ctx.continue_as_new``): CONTINUED, its task due again
        at once with the new params (checked as a publish checks them: their size) and a new
        journal."""
        size = len(bson.encode(renew["params"]))
        if size > self.max_params_bytes:
            return self.failure(
                run,
                f"continue_as_new: the params are {size} bytes as BSON, over the "
                f"{self.max_params_bytes} a task's params may hold",
                permanent=True,
            )
        self.stats.continued += 1
        metrics.by_name(metrics.CONTINUED, run.name).inc()
        self.emit(Event.CONTINUED, key=run.key, run_id=run.run_id)
        return Outcome(run.key, run.run_id, RunState.CONTINUED, renew=renew)

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
        error_class: str | None = None,
    ) -> Outcome:
        """A FAIL; ``error_class``: the importable path of the exception the handler raised,
        if it raised one."""
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
            error_class=error_class,
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

    def unopened(self, run: ActiveRun, why: str) -> Outcome:
        """A run whose worker cannot decrypt its task (``sealing.Unopened``): RELEASED, no
        retry spent, due at once for a worker that holds the key; the run keeps why, and this
        worker's claims skip the task from now on (``store.unopened_by``)."""
        self.stats.released += 1
        self.emit(Event.RELEASED, key=run.key, run_id=run.run_id, reason="no_key", why=why)
        said = f"{UNOPENED} `{run.ctx.worker_id}`: {why}"
        return Outcome(run.key, run.run_id, RunState.RELEASED, error=said)

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
        if reason == "deadline" and run.deadline is not None:
            when = run.deadline.isoformat(timespec="milliseconds")
            return self.failure(run, f"deadline passed: the task had until {when}", permanent=True)
        return None  # lost: another run owns the task; nothing may be written
