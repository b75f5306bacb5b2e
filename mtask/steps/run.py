"""``RunSteps``: one run's durable steps, as its handler asks for them (``ctx.step``,
``ctx.sleep``, ``ctx.wait_for``, …). Each call is a plan of one of its parts, run by its
``Runner`` as one step (``Journal.one``): awaited on the worker's loop (``async def``
handlers) or run here (``*_sync``, plain ``def`` handlers, on a thread or in a child process).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import uuid
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, NoReturn, TypeVar

from mtask.steps.calls import Calls, Gate
from mtask.steps.gather import Group, close_group, open_group
from mtask.steps.journal import Journal, caller
from mtask.steps.plan import Plan
from mtask.steps.policy import NO_POLICY, StepPolicy
from mtask.steps.rules import Doc, StepError
from mtask.steps.runner import Runner
from mtask.steps.spans import StepSpans
from mtask.steps.stores import StepStore
from mtask.steps.values import Values
from mtask.steps.waits import Suspended, Waits

T = TypeVar("T")


class RunSteps:
    """One run's steps, composed of its ``journal`` (the entries, where each step goes, their
    names), its ``runner`` (how a plan's I/O and calls are done) and the kinds of step, each
    recording in the journal: ``calls``, ``waits`` (sleeps, signal and data waits), ``values``
    (values decided once, patch markers); children (``mtask.steps.children``) and gathers
    (``mtask.steps.parallel``) are plans of other modules (``run_plan``).

    ``recorded`` is the claimed document's ``steps``; ``loop`` the worker's event loop, where a
    thread handler's I/O runs (``blocking_io``: how it runs instead); ``release`` where what a
    step's function said goes once its record is written; ``frontier`` what is called with each
    step the journal does not replay (``mtask.steps.preflight``); ``spans`` what is told of each
    step, gather and back-off (``mtask.steps.spans``; ``None``: no tracer); ``gate`` what each
    call step awaits before its function is called (the run's budgets and windows of tokens)."""

    def __init__(
        self,
        store: StepStore,
        recorded: Any,
        *,
        run_id: str,
        attempt: int,
        loop: asyncio.AbstractEventLoop | None = None,
        blocking_io: Callable[[Coroutine[Any, Any, Any]], Any] | None = None,
        release: Callable[[list[Any]], None] | None = None,
        frontier: Callable[[int, str, str, Doc | None], None] | None = None,
        spans: StepSpans | None = None,
        gate: Gate | None = None,
    ) -> None:
        self.journal = Journal(
            store, recorded, run_id=run_id, attempt=attempt, frontier=frontier, spans=spans
        )
        self.runner = Runner(loop, blocking_io)
        self.calls = Calls(self.journal, self.runner, release, gate)
        self.waits = Waits(self.journal)
        self.values = Values(self.journal)

    @property
    def store(self) -> StepStore:
        return self.journal.store

    @property
    def recorded(self) -> list[Doc]:
        """The journal's entries: the recorded ones, as this run rewrote and added to them."""
        return self.journal.recorded

    @property
    def spilled(self) -> bool:
        """Whether this run stored a result aside (its task's retention seals it)."""
        return self.journal.spilled

    @property
    def run_id(self) -> str:
        return self.journal.run_id

    @property
    def attempt(self) -> int:
        return self.journal.attempt

    # -- calls ----------------------------------------------------------------------------------

    def step(
        self,
        name: str,
        fn: Callable[..., Any],
        *args: Any,
        transactional: bool = False,
        policy: StepPolicy | None = None,
        **kw: Any,
    ) -> Coroutine[Any, Any, Any]:
        return self.step_at(
            caller(), name, fn, args, kw, transactional=transactional, policy=policy
        )

    async def step_at(
        self,
        site: Any,
        name: str,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kw: Mapping[str, Any],
        *,
        transactional: bool = False,
        policy: StepPolicy | None = None,
    ) -> Any:
        """``step``, asked for from ``site`` (``caller()``: a loop's site numbers its name)."""
        name = self.journal.numbered(name, site)
        if transactional:
            if policy is not None:
                raise StepError("a transactional step has no policy: its transaction retries")
            return await self.calls.transactional(name, fn, args, dict(kw))
        plan = self.calls.step(name, lambda: fn(*args, **kw), policy or NO_POLICY)
        return await self.run_plan(plan)

    def step_sync(
        self,
        name: str,
        fn: Callable[..., Any],
        *args: Any,
        policy: StepPolicy | None = None,
        **kw: Any,
    ) -> Any:
        return self.step_sync_at(caller(), name, fn, args, kw, policy=policy)

    def step_sync_at(
        self,
        site: Any,
        name: str,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kw: Mapping[str, Any],
        *,
        policy: StepPolicy | None = None,
    ) -> Any:
        name = self.journal.numbered(name, site)
        plan = self.calls.step(name, lambda: fn(*args, **kw), policy or NO_POLICY)
        return self.run_plan_sync(plan)

    def run_plan(self, plan: Plan[T]) -> Coroutine[Any, Any, T]:
        """Run a plan (of a part, or of another module: ``mtask.steps.children``) as one step, on
        the loop."""
        return self.runner.run_async(self.journal.one(plan))

    def run_plan_sync(self, plan: Plan[T]) -> T:
        return self.runner.run_sync(self.journal.one(plan))

    # -- waits ----------------------------------------------------------------------------------

    async def sleep(
        self, duration: float | dt.timedelta | dt.datetime, name: str | None = None
    ) -> None:
        await self.run_plan(self.waits.sleep(duration, name))

    def sleep_sync(
        self, duration: float | dt.timedelta | dt.datetime, name: str | None = None
    ) -> None:
        self.run_plan_sync(self.waits.sleep(duration, name))

    async def wait_for(
        self,
        signal: str,
        timeout: float | dt.timedelta | None = None,  # noqa: ASYNC109 - durable, server clock
        name: str | None = None,
    ) -> Any:
        return await self.run_plan(self.waits.wait_for(signal, timeout, name))

    def wait_for_sync(
        self, signal: str, timeout: float | dt.timedelta | None = None, name: str | None = None
    ) -> Any:
        return self.run_plan_sync(self.waits.wait_for(signal, timeout, name))

    async def wait_until(
        self,
        collection: str,
        predicate: Mapping[str, Any],
        timeout: float | dt.timedelta | None = None,  # noqa: ASYNC109 - durable, server clock
        name: str | None = None,
    ) -> Any:
        return await self.run_plan(self.waits.wait_until(collection, predicate, timeout, name))

    def wait_until_sync(
        self,
        collection: str,
        predicate: Mapping[str, Any],
        timeout: float | dt.timedelta | None = None,
        name: str | None = None,
    ) -> Any:
        return self.run_plan_sync(self.waits.wait_until(collection, predicate, timeout, name))

    def continue_as_new(self, params: Any) -> NoReturn:
        """End the run; the task starts afresh with ``params`` and a new journal."""
        raise Suspended(self.waits.renewal(params))

    # -- gathers, values decided once, patches --------------------------------------

    def numbered(self, name: str, site: Any) -> str:
        return self.journal.numbered(name, site)

    def group(self) -> Group | None:
        """The ``ctx.gather`` this context's steps belong to, if any."""
        return self.journal.group()

    def open_group(self, name: str | None) -> Group:
        return open_group(self.journal, name)

    def close_group(self, group: Group, completed: bool) -> None:
        close_group(self.journal, group, completed)

    def flush(self) -> Plan[None]:
        """Write the entries decided without I/O (before a gather begins)."""
        return self.journal.flush()

    def value(self, prefix: str, make: Callable[[], Any]) -> Any:
        return self.values.value(prefix, make)

    def now(self) -> dt.datetime:
        return self.values.now()

    def uuid(self) -> uuid.UUID:
        return self.values.uuid()

    def patched(self, patch: str) -> bool:
        return self.values.patched(patch)

    def deprecate_patch(self, patch: str) -> None:
        self.values.deprecate_patch(patch)
