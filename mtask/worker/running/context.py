"""Each run's context (``RunContexts``): the ``TaskContext`` its handler gets, and what that
context owns: the run's live output, its journal of durable steps, and its fence.

- the output (``ctx.progress``/``log``/``emit``) is made on the handler's first report, by the
  worker's ``RunOutputs`` (``output_writer.OutputWriter``), and written last at the run's end
  (``output_done``): a run that reports nothing costs nothing here;
- the journal (``ctx.step``/``sleep``/``wait_for``) is made on the handler's first step, by the
  worker's ``RunJournals`` (``step_stores.RunStepStores``), while the run is in flight;
- the fence (``fence``) is what a run's transaction adds, a transactional handler's or a
  step's (``transactional.RunFence``): the sessions of earlier runs to kill, and its lease's
  pause, hold and resume (``RunLeases``: the ``LeasePinger`` in a worker).

The executor makes each run's context here (``context``) and ends it here (``output_done``,
``ended``); the handler's call (``call.HandlerCalls``) takes the fence from ``fence``. Nothing
here decides an outcome: it only marks an outcome with what the run left to seal (its output,
its step results stored aside). ``NoOutputs`` and ``NoLeases`` are the forms that do nothing
(``mtask.testing.run_handler`` passes them).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

from mtask.follow.output import RunOutput
from mtask.registry import Registry, TaskContext
from mtask.steps import RunSteps, StepError
from mtask.steps.calls import Gate
from mtask.store import Outcome
from mtask.store.transactional import stale_sessions
from mtask.worker.inflight import ActiveRun, InFlight
from mtask.worker.running.transactional import RunFence
from mtask.worker.running.usage_stores import RunUsages

log = logging.getLogger(__name__)


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
    """Outside a worker: a run's output stays in its buffer, where a test reads it
    (``mtask.follow.output.RecordedOutput``)."""

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
    """Where the runs' durable steps are recorded (``step_stores.RunStepStores``)."""

    def steps_for(
        self,
        ctx: TaskContext,
        gate: Gate,
        *,
        doc: Mapping[str, Any],
        transactional: bool,
        fence: Callable[[], RunFence],
        loop: asyncio.AbstractEventLoop,
    ) -> RunSteps: ...


class RunLeases(Protocol):
    """The leases of the runs in flight, as a run sees them (``LeasePinger`` in a worker)."""

    def expiry(self, run_id: str) -> float | None: ...

    def watch(self, run_id: str, on_expiry: Callable[[float], None]) -> Callable[[], None]: ...

    def pause(self, run_id: str) -> None: ...

    def held(self, run_id: str, sent: float) -> float | None: ...

    def resume(self, run_id: str) -> None: ...


class NoLeases:
    """Outside a worker: nothing pings, nothing expires."""

    def expiry(self, run_id: str) -> float | None:
        return None

    def watch(self, run_id: str, on_expiry: Callable[[float], None]) -> Callable[[], None]:
        return lambda: None

    def pause(self, run_id: str) -> None:
        pass

    def held(self, run_id: str, sent: float) -> float | None:
        return None

    def resume(self, run_id: str) -> None:
        pass


def fence(run: ActiveRun, doc: Mapping[str, Any], leases: RunLeases) -> RunFence:
    """What a run's transaction adds (a transactional handler's, or a step's): the one
    definition of a run's fence."""
    return RunFence(
        run.key,
        run.run_id,
        run.ctx.worker_id,
        tuple(stale_sessions(doc.get("runs"), run.run_id)),
        alive=lambda: run.stop_reason is None and not run.ctx.cancelled.is_set(),
        pause=lambda: leases.pause(run.run_id),
        held=lambda sent: leases.held(run.run_id, sent),
        resume=lambda: leases.resume(run.run_id),
    )


def spilled(run: ActiveRun, doc: Mapping[str, Any]) -> bool:
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


class RunContexts:
    """Makes each run's ``TaskContext`` and owns what it makes on first use: the run's output
    (``outputs``), its journal (``journals``) and its fence (``leases``). ``inflight``: a step
    is only made while its run is in flight."""

    def __init__(
        self,
        *,
        registry: Registry,
        worker_id: str,
        publisher: Callable[..., Awaitable[Any]],
        inflight: InFlight,
        outputs: RunOutputs,
        journals: RunJournals,
        leases: RunLeases,
        usages: RunUsages | None = None,
    ) -> None:
        self.usages = usages
        """Where ``ctx.record_usage`` charges, and the budgets a step checks (docs/usage.md);
        ``None``: in memory."""
        self.registry = registry
        self.worker_id = worker_id
        self.publisher = publisher
        self.inflight = inflight
        self.outputs = outputs
        """Where ``ctx.progress``/``log``/``emit`` go: written under the run's fence; a
        transactional run's in its transaction."""
        self.journals = journals
        """Where ``ctx.step``/``sleep``/``wait_for`` record (docs/steps.md)."""
        self.leases = leases
        """A run's transaction pauses its pings while it is open (its fence)."""

    def context(self, doc: Mapping[str, Any]) -> TaskContext:
        """The context of the run a claim just made of ``doc`` (on the event loop)."""
        loop = asyncio.get_running_loop()
        return TaskContext(
            key=doc["_id"],
            name=doc["name"],
            attempt=doc["attempts"],
            run_id=doc["claim_run_id"],
            worker_id=self.worker_id,
            publisher=self.publisher,
            output_for=functools.partial(
                self.outputs.output_for,
                options=doc["options"],
                held=self.registry[doc["name"]].transactional,
                loop=loop,
            ),
            # a method and its arguments, not a closure over the run: the run holds this
            # context, so a closure would make a cycle that only the garbage collector frees
            steps_for=functools.partial(self._steps_for, doc=doc, loop=loop),
            **self._usage_for(doc, loop),
        )

    def _usage_for(self, doc: Mapping[str, Any], loop: asyncio.AbstractEventLoop) -> dict[str, Any]:
        """``TaskContext.usage_for``: the run's usage on MongoDB (made on its first charge or
        step), where the worker has a ``RunUsages``."""
        if self.usages is None:
            return {}
        return {"usage_for": functools.partial(self.usages.usage_for, doc=doc, loop=loop)}

    def _steps_for(
        self,
        made: TaskContext,
        gate: Gate,
        *,
        doc: Mapping[str, Any],
        loop: asyncio.AbstractEventLoop,
    ) -> RunSteps:
        """``TaskContext.steps_for``: the run's journal, made when its handler first asks for a
        step, a sleep or a wait (while it runs: the run is in flight)."""
        run = self.inflight.get(made.run_id)
        if run is None:
            raise StepError(f"the run {made.run_id[:8]} of {made.key!r} has ended: no more steps")
        return self.journals.steps_for(
            made,
            gate,
            doc=doc,
            transactional=self.registry[run.name].transactional,
            fence=lambda: self.fence(run, doc),
            loop=loop,
        )

    def fence(self, run: ActiveRun, doc: Mapping[str, Any]) -> RunFence:
        """What the run's transaction adds (``fence``), with this worker's leases."""
        return fence(run, doc, self.leases)

    async def output_done(self, run: ActiveRun, outcome: Outcome | None) -> Outcome | None:
        """Before the outcome is recorded: write what the run said last (nothing if it lost
        its task); an outcome of a run that stored lines or chunks seals them once recorded."""
        output = run.ctx.output_made
        if output is None:
            return outcome  # it said nothing: no cost
        try:
            stored = await self.outputs.finish(output, write=outcome is not None)
        except Exception:  # the output is lost, never the run's outcome
            log.exception("the output of %s run %s could not be finished", run.key, run.run_id[:8])
            stored = True  # some may be stored: the outcome seals them (sealing none is cheap)
        if outcome is not None and stored:
            return dataclasses.replace(outcome, has_output=True)
        return outcome

    async def ended(
        self, run: ActiveRun, doc: Mapping[str, Any], outcome: Outcome | None
    ) -> Outcome | None:
        """The handler ended with ``outcome``: its output done (``output_done``), and an
        outcome of a task holding step results stored aside seals them once recorded."""
        if run.ctx.output_made is not None:  # else it said nothing: not even a coroutine
            outcome = await self.output_done(run, outcome)
        if outcome is not None and spilled(run, doc):
            return dataclasses.replace(outcome, has_spills=True)
        return outcome
