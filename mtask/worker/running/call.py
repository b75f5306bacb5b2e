"""A run's handler called (``HandlerCalls``): under its slot, in its trace span, by ``invoke``
(the event loop, a thread, or a child process of the pool) or in its transaction; what it
returned or raised is made the run's ``Outcome`` by ``RunOutcomes``.

What only the call can fail with is told here, each by its own words: a child that died or was
killed at its time or memory limit, a reply the worker refused, a transaction that took too
long, was ended by the handler, or lost its task before it committed. A transactional
handler's body runs in ``TransactionRunner.complete`` with the run's fence
(``context.fence``): its writes through ``ctx.session``, what it said (``HeldOutputs``) and the
run's SUCCESS commit together. ``NoTransactions`` is the form that does nothing
(``mtask.testing.run_handler`` passes it when it has no MongoDB).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Literal, Protocol

from mtask import metrics
from mtask.errors import ConfigError, InvalidTask, LeaseLost, StorageError
from mtask.limits.holds import BackOff
from mtask.registry import Handler
from mtask.statemachine import keep_ms
from mtask.steps import Suspended
from mtask.store import Outcome, RunState
from mtask.tracing import run_ended, run_span
from mtask.vocabulary import OPTION_DEFAULTS
from mtask.worker.inflight import ActiveRun
from mtask.worker.running.backoffs import Holds
from mtask.worker.running.batches import Batches
from mtask.worker.running.context import RunLeases, fence
from mtask.worker.running.handler_slots import GiveBack
from mtask.worker.running.invoke import invoke
from mtask.worker.running.outcomes import RunOutcomes
from mtask.worker.running.pool.errors import (
    ChildDied,
    HandlerError,
    MemoryLimitExceeded,
    ReplyRefused,
    TimeLimitExceeded,
)
from mtask.worker.running.sealing import Plain, Sealing, Unopened
from mtask.worker.running.traces import RunTraces
from mtask.worker.running.transactional import RunFence, TransactionEnded, TransactionTooLong
from mtask.worker.worker_events import Emitter, Event

if TYPE_CHECKING:  # the process pool: imported by a worker that has one (assembly)
    from mtask.worker.running.pool.pool import LeaseWatch, ProcessPool

CALL_FAILED: tuple[type[Exception], ...] = (
    TransactionTooLong,
    HandlerError,  # what the handler raised in its child, or a BaseException here
    ChildDied,
    TimeLimitExceeded,
    MemoryLimitExceeded,
)
"""The call failed, told by its own words: the run is retried (it uses a retry)."""
CALL_REFUSED: tuple[type[Exception], ...] = (TransactionEnded, ReplyRefused)
"""The call cannot succeed, told by its own words: the same on every run, a permanent FAIL."""
log = logging.getLogger(__name__)

LOST_IN_TRANSACTION = (
    "the run lost the task before its transaction committed; nothing it wrote landed"
)


@dataclasses.dataclass(frozen=True)
class RunHeld:
    """``invoke.Held`` of a run that holds a sequence's lock or limit slots: told to stop, its
    handler went on, and the run keeps them until it has stopped; said by an event and the
    ``mtask_runs_held`` gauge."""

    run: ActiveRun
    emit: Emitter

    def began(self) -> None:
        metrics.RUNS_HELD.inc()
        log.warning(
            "%s run %s was told to stop, but its handler goes on: it keeps its lock and slots "
            "(%s) until it has stopped",
            self.run.key,
            self.run.run_id[:8],
            ", ".join(self.run.slots),
            extra={"key": self.run.key, "run_id": self.run.run_id},
        )
        self.emit(Event.HELD, key=self.run.key, run_id=self.run.run_id, released=False)

    def ended(self) -> None:
        metrics.RUNS_HELD.dec()
        self.emit(Event.HELD, key=self.run.key, run_id=self.run.run_id, released=True)


class LeaseRanOut(Exception):
    """The run's lease ran out by this process's clock before its handler began: the process
    was frozen (or MongoDB out of reach) between its claim, or its last ping, and its start. Its
    task, and any limit's place it took, may be another run's by now, so its handler is not
    called (the run is lost, as when the lease runs out while the handler runs)."""


class TransactionRunner(Protocol):
    """How a transactional handler's writes and its run's SUCCESS commit together
    (``transactional.Transactions`` in a worker)."""

    async def complete(
        self,
        handler: Callable[[Any], Awaitable[Any]],
        outcome_for: Callable[[Any], Outcome],
        fence: RunFence | None = None,
    ) -> tuple[Any, dict[str, Any]]: ...


class NoTransactions:
    """Without MongoDB: a transactional handler cannot run there."""

    async def complete(
        self,
        handler: Callable[[Any], Awaitable[Any]],
        outcome_for: Callable[[Any], Outcome],
        fence: RunFence | None = None,
    ) -> tuple[Any, dict[str, Any]]:
        raise ConfigError("a transactional handler needs MongoDB to run its transaction in")


class HeldOutputs(Protocol):
    """A transactional run's output, held until its body returns (``context.RunOutputs``)."""

    async def write_in(self, output: Any, session: Any) -> None: ...

    def restart(self, output: Any) -> None: ...


def backed_off(exc: BackOff, name: str, group: str | None, until: Any) -> str:
    """What a run ended by ``BackOff`` says (kept on the run, read by ``explain``): ``backed
    off group `globex` of `send_email` until 2026-11-28 03:12:17 UTC, by its handler: 429 from the
    provider``."""
    from mtask.explain.wording import when

    if exc.resource is not None:
        whose = f"resource `{exc.resource}`"
    elif exc.group:
        whose = f"group `{group}` of `{name}`"
    else:
        whose = f"`{name}`"
    reason = str(exc) if str(exc) and str(exc) != "backing off" else ""
    said = f"backed off {whose} until {when(until)} UTC, by its handler"
    return f"{said}: {reason}" if reason else said


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _max_backoffs(doc: dict[str, Any]) -> int:
    """The task's ``options.max_backoffs`` (its default where the document lacks it)."""
    options = doc.get("options")
    value = options.get("max_backoffs") if isinstance(options, dict) else None
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    default: int = OPTION_DEFAULTS["max_backoffs"]
    return default


class HandlerCalls:
    """Calls each run's handler and says how the run ended (``call``)."""

    def __init__(
        self,
        outcomes: RunOutcomes,
        *,
        transactions: TransactionRunner,
        leases: RunLeases,
        outputs: HeldOutputs,
        pool: ProcessPool | None = None,
        isolation: Literal["thread", "process"] = "thread",
        slots: contextlib.AbstractAsyncContextManager[Any] | None = None,
        sealing: Sealing | None = None,
        batches: Batches | None = None,
        holds: Holds | None = None,
        traces: RunTraces | None = None,
    ) -> None:
        self.traces = traces
        """Where a task's first traced run stores the trace it began (``None``: nowhere)."""
        self.batches = batches or Batches()
        """The open batches of batch handlers, each called once for its tasks."""
        self.holds = holds
        """Where a ``BackOff`` writes its hold (``None``: without MongoDB it cannot)."""
        self.sealing = sealing or Plain()
        """Encrypted tasks' params opened for the handler, their results sealed."""
        self.outcomes = outcomes
        """What the handler's return or exception makes of the run."""
        self.transactions = transactions
        """How transactional handlers open their transactions."""
        self.leases = leases
        """A transactional run pauses its pings while its transaction is open (its fence); a
        process-isolated run's child follows its lease's renewals."""
        self.outputs = outputs
        """A transactional run's output, written in its transaction."""
        self.pool = pool
        """Child processes for process-isolated plain-def handlers."""
        self.isolation = isolation
        """The worker-wide default for plain-def handlers that do not declare one."""
        self.slots = slots or contextlib.nullcontext()
        """A run waits here for a slot, which only a run claimed ahead (``WorkerConfig.prefetch``,
        ``claim_ahead.RunSlots``) has to do; ``GiveBack`` from it records the run RELEASED
        (``None``: this worker never claims ahead, so no run waits)."""

    async def call(self, run: ActiveRun, handler: Handler, doc: dict[str, Any]) -> Outcome:
        """Take a slot (only a run claimed ahead may wait for one), run the handler in it, and
        say how the run ended. Raises ``LeaseRanOut`` instead of calling a handler whose run's
        lease has already run out (the timer that stops such runs may not have fired yet)."""
        try:
            async with self.slots:
                run.waiting = False
                run.running_since = time.monotonic()
                expiry = self.leases.expiry(run.run_id)
                if expiry is not None and expiry <= run.running_since:
                    raise LeaseRanOut
                return await self._run(run, handler, doc)
        except GiveBack:  # claimed ahead, it waited too long for its slot (claiming/ahead.py)
            return self.outcomes.given_back(run)

    async def _run(self, run: ActiveRun, handler: Handler, doc: dict[str, Any]) -> Outcome:
        """Run the handler in its run's span and say how the run ended."""
        # the CONSUMER run span, child of the task's stored trace context (the publisher's,
        # or the one its first run made: stored here, fenced by the run)
        with run_span(doc, run.name, run.key, run.ctx.attempt, run.run_id) as made:
            if made is not None and self.traces is not None:
                await self.traces.keep(run.key, run.run_id, made)
            outcome = await self._called(run, handler, doc)
            run_ended(outcome.state.value, outcome.retry_delay_ms, outcome.permanent)
            return outcome

    async def _called(self, run: ActiveRun, handler: Handler, doc: dict[str, Any]) -> Outcome:
        """Run the handler and say how the run ended (an exception is the task's failure)."""
        try:
            if handler.transactional:
                return await self._transactional(run, handler, doc)
            if handler.batch is not None:  # this task's entry of its batch
                params = await self.sealing.params(doc)
                result = await self.batches.call(run.key, handler, params, run.ctx)
                stored = self.sealing.result(doc, result)
                return self.outcomes.success(
                    run, stored, keep_ms(doc.get("options") or {}, "succeeded")
                )
            result = await invoke(
                handler,
                await self.sealing.params(doc),
                run.ctx,
                pool=self.pool,
                isolation=self.isolation,
                thread_name=f"mtask-run-{run.key}",
                lease=self._lease_watch(run),
                held=RunHeld(run, self.outcomes.emit) if run.slots else None,
            )
            # the retention the plain SUCCESS updates write
            stored = self.sealing.result(doc, result)
            return self.outcomes.success(
                run, stored, keep_ms(doc.get("options") or {}, "succeeded")
            )
        except asyncio.CancelledError:
            raise  # the run is stopped: its outcome follows from why (``RunOutcomes.stopped``)
        except CALL_FAILED as exc:  # a HandlerError names the class its handler raised
            kind = exc.error_class if isinstance(exc, HandlerError) else None
            return self.outcomes.failure(run, str(exc), error_class=kind)
        except CALL_REFUSED as exc:
            return self.outcomes.failure(run, str(exc), permanent=True)
        except BackOff as exc:  # its group, name or resource held, the run released
            return await self._backed_off(run, exc, doc)
        except Unopened as exc:  # this worker cannot decrypt it: given back, no retry spent
            return self.outcomes.unopened(run, exc.why)
        except BaseException as exc:  # noqa: BLE001 - any handler error is the task's failure:
            # sys.exit() (argparse's error) or a class of its own too; up in its task, asyncio
            # hands a SystemExit or KeyboardInterrupt to the event loop (the worker's end), any
            # other would end the task with no outcome (its task RUNNING until its lease ran out)
            return self._raised(run, doc, exc)

    def _raised(self, run: ActiveRun, doc: dict[str, Any], exc: BaseException) -> Outcome:
        """The outcome of a handler that raised ``exc``; a run that continues as new
        (``ctx.continue_as_new``) with its new params sealed as its task's are (an encrypted
        task's stay encrypted)."""
        renew = exc.wait.renew if isinstance(exc, Suspended) else None
        if renew is None:
            return self.outcomes.raised(run, exc)
        try:
            params = self.sealing.renewed(doc, renew["params"])
        except Unopened as closed:  # the key was rotated away while the handler ran
            return self.outcomes.unopened(run, closed.why)
        return self.outcomes.continued(run, {**renew, "params": params})

    async def _backed_off(self, run: ActiveRun, exc: BackOff, doc: dict[str, Any]) -> Outcome:
        """A ``BackOff``: the hold written first, then the run RELEASED (no retry spent) saying
        what it held until when; a hold that cannot be written is the run's failure (retried
        as any). Past the task's ``max_backoffs`` the hold is kept and the task fails for good,
        saying so."""
        if self.holds is None:
            return self.outcomes.failure(run, "BackOff needs MongoDB to hold what it names")
        try:
            until = await self.holds.hold(exc, run.name, run.group)
        except InvalidTask as bad:
            return self.outcomes.failure(run, f"back-off refused: {bad}", permanent=True)
        except StorageError as bad:
            return self.outcomes.failure(run, f"back-off not recorded: {bad}")
        what = f"resource {exc.resource}" if exc.resource else "group" if exc.group else "name"
        held = "resource" if exc.resource else "tenant" if exc.group else "name"  # no "group"
        # in the metrics' text: their labels are bounded, and a group's name is a tenant's
        metrics.BACKOFFS.labels(name=run.name, held=held).inc()
        said = backed_off(exc, run.name, run.group, until)
        cap = _max_backoffs(doc)
        if _count(doc.get("backoffs")) + 1 > cap:
            return self.outcomes.failure(
                run, f"BackOffExceeded: more back-offs than max_backoffs ({cap}); the last: {said}",
                permanent=True,
            )  # fmt: skip
        self.outcomes.stats.released += 1
        self.outcomes.emit(
            Event.RELEASED, key=run.key, run_id=run.run_id, reason="backoff", held=what,
            until=until.isoformat(timespec="milliseconds"),
        )  # fmt: skip
        # its own task is due once the hold ends (a hold an earlier back-off made later: then),
        # whether or not its name takes what is held
        delay_ms = math.ceil(
            max(exc.seconds, (until - self.holds.clock.now()).total_seconds()) * 1000
        )
        return Outcome(
            run.key, run.run_id, RunState.RELEASED, error=said, retry_delay_ms=delay_ms,
            backed_off=True,
        )  # fmt: skip

    def _lease_watch(self, run: ActiveRun) -> LeaseWatch | None:
        """How a process-isolated run's child follows the run's lease (renewals from the
        pinger), so it can stop itself if the worker stops renewing (a frozen worker)."""
        return functools.partial(self.leases.watch, run.run_id)

    async def _transactional(
        self, run: ActiveRun, handler: Handler, doc: dict[str, Any]
    ) -> Outcome:
        """The handler and the run's SUCCESS in one transaction; the SUCCESS outcome returned is
        ``committed`` (the recorder does not write it again). A result that cannot be stored
        aborts the transaction and is the run's FAIL. The transactions of earlier runs of the
        task whose lease expired are killed first (``RunFence``)."""
        built: list[Outcome] = []  # the last is the one committed (a body may run again)

        def outcome_for(result: Any) -> Outcome:
            keep = keep_ms(doc.get("options") or {}, "succeeded")
            # counted once committed (``succeeded`` below)
            stored = self.sealing.result(doc, result)
            outcome = self.outcomes.success(run, stored, keep, count=False)
            if outcome.state is not RunState.SUCCESS:
                raise _NotStored(outcome)
            built.append(outcome)
            return outcome

        try:
            params = handler.parse(await self.sealing.params(doc))
            body = functools.partial(self._body, run, handler.fn, params)
            await self.transactions.complete(body, outcome_for, fence(run, doc, self.leases))
        except _NotStored as refused:
            return refused.outcome
        except LeaseLost:
            return self.outcomes.failure(run, LOST_IN_TRANSACTION)
        self.outcomes.succeeded(run)
        return dataclasses.replace(built[-1], committed=True)

    async def _body(
        self, run: ActiveRun, fn: Callable[..., Awaitable[Any]], params: Any, session: Any
    ) -> Any:
        """A transactional handler's body, in its transaction (run again if that is retried):
        ``ctx.session`` is the transaction's while it runs, and what the handler said is held
        and written in it."""
        run.ctx.session = session
        held = run.ctx.output_made
        if held is not None:  # a body run again: the aborted one's output is gone
            self.outputs.restart(held)
        try:
            result = await fn(params, run.ctx)
            said = run.ctx.output_made
            if said is not None:  # commits with the SUCCESS, or not at all
                await self.outputs.write_in(said, session)
            return result
        finally:
            run.ctx.session = None


class _NotStored(Exception):
    """A transactional handler's result cannot be stored: abort, and fail the run."""

    def __init__(self, outcome: Outcome) -> None:
        super().__init__(outcome.error)
        self.outcome = outcome
