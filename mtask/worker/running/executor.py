"""Running a claimed task: the run's lifecycle (``Executor``).

``Executor.start`` turns a claimed document into a run in flight: its ``TaskContext``
(``context.RunContexts``), a lease the pinger extends, a local deadline, and the handler's
asyncio task. That task calls the handler (``call.HandlerCalls``: its outcome, by
``outcomes.RunOutcomes``), ends the run's context (its last output written), and hands the
outcome to the outcome writer (``recorder.OutcomeRecorder``) once the run has left the in-flight
ledger. A run whose lease was lost (the pinger found another run owns the task, or its local
deadline passed first) is stopped and records nothing; a cancelled task's run records
CANCELLED; a run stopped by the worker's shutdown records RELEASED.

The executor knows nothing of the claim side but two signals (``run_started``, ``run_ended``),
which the claim side connects to when it is built (River's executor and its producer's
callbacks).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any

from mtask import metrics
from mtask.limits import rules as limits
from mtask.registry import Registry
from mtask.store import Outcome
from mtask.worker.inflight import ActiveRun, InFlight
from mtask.worker.running.call import HandlerCalls, LeaseRanOut
from mtask.worker.running.context import RunContexts
from mtask.worker.running.deadlines import Deadlines
from mtask.worker.running.invoke import ASYNC_CANCEL_GRACE
from mtask.worker.running.outcomes import RunOutcomes
from mtask.worker.running.pinger import LeasePinger
from mtask.worker.running.recorder import OutcomeRecorder
from mtask.worker.running.task_deadlines import TaskDeadlines, deadline_of
from mtask.worker.stats import WorkerStats
from mtask.worker.wiring import Signal
from mtask.worker.worker_events import Emitter, Event

log = logging.getLogger(__name__)


class Executor:
    """Starts claimed runs and sees each to its end (River's job executor).

    Ownership: runs live in the ``InFlight`` ledger, written here on the event loop's thread;
    ``lost`` is called on the loop too (the pinger delivers it with ``call_soon_threadsafe``).
    """

    def __init__(
        self,
        *,
        registry: Registry,
        inflight: InFlight,
        pinger: LeasePinger,
        recorder: OutcomeRecorder,
        contexts: RunContexts,
        calls: HandlerCalls,
        outcomes: RunOutcomes,
        stats: WorkerStats,
        wake: asyncio.Event,
        emit: Emitter,
        lost: Signal[[str, dict[str, Any] | None]],
        slot_lost: Signal[[str, str]],
        task_deadlines: TaskDeadlines,
        run_started: Signal[[str]],
        run_ended: Signal[[float]],
    ) -> None:
        self.registry = registry
        self.inflight = inflight
        self.pinger = pinger
        self.recorder = recorder
        self.contexts = contexts
        """Each run's ``TaskContext``, its output, journal and fence."""
        self.calls = calls
        """Each run's handler called, and the outcome of its return or exception."""
        self.outcomes = outcomes
        """The outcome of a run stopped (``stopped``)."""
        self.run_started = run_started
        """Told each run's key as it starts (the claim side: the key leaves its claim queue)."""
        self.run_ended = run_ended
        """Told how long each run's handler ran, from its slot to its end (the claim side
        learns whether to claim ahead); a run stopped while it waited for its slot says
        nothing."""
        lost.connect(self.lost)  # the pinger found a run's task another's
        slot_lost.connect(self.slot_lost)  # ... or its limit's slot another run's
        self.stats = stats
        self.wake = wake
        """The claimer's wake-up: set when a run ends (a slot is free)."""
        self.emit = emit
        self.deadlines = Deadlines(pinger, inflight.active, self._lease_ran_out)
        """One timer for every run's local deadline (its lease's end by this clock)."""
        self.task_deadlines = task_deadlines
        """Each run of a task with a deadline stopped there: its task fails."""
        task_deadlines.passed.connect(lambda run: self.stop(run, "deadline"))

    def start(
        self,
        doc: dict[str, Any],
        sent: float,
        slots: tuple[str, ...] = (),
        tokens: frozenset[str] = frozenset(),
    ) -> None:
        """Run a claimed task: ``sent`` is when (monotonic) the claim that took it began,
        before it read the time its leases end from; ``slots`` the limit slots the run holds
        (a name's, a group's, a sequence's lock), ``tokens`` those of them it was only granted
        a token of (``slots.Taken.holder``)."""
        ctx = self.contexts.context(doc)
        options = doc["options"]
        run = ActiveRun(
            key=ctx.key,
            name=ctx.name,
            run_id=ctx.run_id,
            ctx=ctx,
            slots=slots,
            group=g if isinstance(g := options.get("group"), str) else None,
            lease_ms=options["worker_timeout_ms"],
            has_dependents=doc.get("has_dependents") is True,
            child_of=doc.get("spawn") if isinstance(doc.get("spawn"), dict) else None,
            deadline=deadline_of(doc["options"]),
        )
        self.inflight.started(run)
        self.run_started(run.key)
        self.pinger.add(
            run.key,
            run.run_id,
            options["ping_interval_ms"],
            options["worker_timeout_ms"],
            sent,
            slots=tuple(s for s in slots if not limits.is_claim_lock(s)) if slots else (),
            tokens=tokens,
            holds=bool(slots),
        )
        run.task = asyncio.create_task(self.execute(run, doc), name=f"mtask-run-{run.key}")
        self.deadlines.watch(run)
        self.task_deadlines.watch(run)
        metrics.by_name(metrics.CLAIMED, run.name).inc()
        metrics.IN_FLIGHT.inc()
        self.emit(Event.CLAIMED, key=run.key, run_id=run.run_id, attempt=ctx.attempt)

    @property
    def unwritten(self) -> int:
        """``RunStarter``: the outcomes waiting to be written."""
        return self.recorder.unwritten

    def give_back(self, slot: str, run_id: str) -> None:
        """``RunStarter``: a limit slot given back after the outcomes now pending."""
        self.recorder.release_slot(slot, run_id)

    def hold(self, run_id: str, slot: str) -> bool:
        """``RunStarter``: the run holds ``slot`` from now on (pinged, given back at its end)."""
        if (run := self.inflight.get(run_id)) is not None:
            run.slots = run.slots if slot in run.slots else (*run.slots, slot)
            self.pinger.hold(run_id, slot)
        return run is not None

    async def execute(self, run: ActiveRun, doc: dict[str, Any]) -> None:
        run.begun = True
        outcome: Outcome | None
        try:
            if run.stop_reason is not None:  # stopped before its task took a step
                raise asyncio.CancelledError
            outcome = await self.calls.call(run, self.registry[run.name], doc)
            if run.stop_reason == "lost" and not (outcome is not None and outcome.committed):
                outcome = None  # its handler ignored its stop: its lease is gone (a SUCCESS
                # its transaction committed, fenced by the lease, still has what follows it)
            outcome = await self.contexts.ended(run, doc, outcome)
        except (asyncio.CancelledError, LeaseRanOut) as stopped:
            if isinstance(stopped, LeaseRanOut):  # frozen between its claim and its start
                self._lease_ran_out(run)
            outcome = self.outcomes.stopped(run)
            if outcome is None and run.stop_reason is None:
                raise
            outcome = await self.contexts.output_done(run, outcome)
        finally:
            metrics.IN_FLIGHT.dec()
            ended = time.monotonic()
            metrics.by_name(metrics.RUN_DURATION, run.name).observe(ended - run.started)
            if not run.waiting:
                self.run_ended(ended - run.running_since)
            self.inflight.ended(run)
            self.task_deadlines.forget(run)
            self.pinger.remove(run.run_id)
            for slot in run.slots:  # given back by the outcome writer, after the outcome
                self.recorder.release_slot(slot, run.run_id)
            self.wake.set()
        if outcome is not None:
            if run.child_of is not None:  # counted on its parent once recorded
                outcome = dataclasses.replace(outcome, child_of=run.child_of)
            self.recorder.add(outcome)

    def _lease_ran_out(self, run: ActiveRun) -> None:
        """``Deadlines``: the run's lease ran out by this process's clock before a ping could
        extend it; stop it before any other worker can take its task over."""
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

    def slot_lost(self, run_id: str, slot: str) -> None:
        """The run's task is still its own, but a limit's slot it held was taken by another
        run after its lease there ran out (the process frozen or cut off past it): stop its
        handler and give the task back (RELEASED), so that the limit holds."""
        run = self.inflight.get(run_id)
        if run is None or run.task is None or run.stop_reason is not None:
            return  # ended, or already being stopped
        self.stats.slots_lost += 1
        log.warning(
            "slot lost: %s run %s no longer holds its slot of %s (its lease there ran out and "
            "another run took it); the run is stopped and its task given back",
            run.key,
            run_id[:8],
            slot,
            extra={"key": run.key, "run_id": run_id},
        )
        self.stop(run, "slot_lost")

    def stop(self, run: ActiveRun, reason: str) -> None:
        """Cancel a run's handler for ``reason`` (its outcome follows from the reason)."""
        run.stop_reason = reason
        if reason != "shutdown":
            self.emit(Event.STOPPING_RUN, key=run.key, run_id=run.run_id, reason=reason)
        run.ctx.cancelled.set()
        # a task that has not begun sees stop_reason as it begins; one that stops itself (its
        # lease ran out as it began) is not cancelled: it is already on its way out
        if run.task is not None and run.begun and run.task is not asyncio.current_task():
            run.task.cancel()

    async def drain(self, grace: float, stop_now: asyncio.Event) -> None:
        """Wait up to ``grace`` seconds (or until ``stop_now``) for the runs in flight, then
        stop the rest for "shutdown" (they record RELEASED) and wait until they have ended, at
        most ``ASYNC_CANCEL_GRACE`` seconds: a run still going then is abandoned."""
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
            _, stuck = await asyncio.wait(stopping, timeout=ASYNC_CANCEL_GRACE)
            for run in [r for r in self.inflight.runs.values() if r.task in stuck]:
                self.abandon(run)
        self.deadlines.close()  # every run has ended or is abandoned: no timer is left behind

    def abandon(self, run: ActiveRun) -> None:
        """A run whose handler did not end when cancelled at shutdown (an ``async def`` that
        swallows ``CancelledError``): the worker stops without it. Nothing is recorded for it,
        ever: it is no longer pinged, so its lease runs out and another worker takes its task
        then; a RELEASED now would let another worker start it while it still runs here."""
        run.stop_reason = "lost"  # should it end after all, it records nothing
        run.ctx.lease_lost = True
        self.pinger.remove(run.run_id)
        log.warning(
            "stopping: %s run %s did not end within %gs of its cancel (does its handler "
            "swallow CancelledError?); left behind: its lease runs out",
            run.key,
            run.run_id[:8],
            ASYNC_CANCEL_GRACE,
            extra={"key": run.key, "run_id": run.run_id},
        )
