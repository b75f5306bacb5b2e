"""Handlers: ``registry = Registry()``, ``@registry.task("name")``, and what a handler may
raise (``Retry``, ``Fail``) or receive (``TaskContext``)."""

from __future__ import annotations

import asyncio
import datetime as dt
import functools
import importlib
import inspect
import sys
import threading
import typing
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, NoReturn, TypeVar

from mtask.errors import InvalidParams, InvalidTask, LeaseLost, MtaskError, RegistryNotFound
from mtask.follow.output import RunLog, RunOutput
from mtask.limits.batches import DEFAULT_BATCH_TIMEOUT
from mtask.limits.batches import check as check_batch
from mtask.steps import MemorySteps, RunSteps, caller
from mtask.steps.calls import Gate
from mtask.steps.policy import StepPolicy
from mtask.triggers import Trigger, check_collection
from mtask.vocabulary import MAX_RETRY_DELAY_MS, delay_ms

if TYPE_CHECKING:
    from pydantic import BaseModel

    from mtask.models import Budget, TaskOptions
    from mtask.schedules.definition import Schedule
    from mtask.usage.charges import RunUsage
    from mtask.usage.rules import Price, Usage


F = TypeVar("F", bound=Callable[..., Any])
Isolation = Literal["thread", "process"]
ISOLATIONS = ("thread", "process")
_OUTPUT_LOCK = threading.Lock()


class Retry(Exception):
    """Raise from a handler to run the task again later. It uses the task's retry budget, like
    any failure, but ``delay`` (seconds or a timedelta) replaces the backoff when given."""

    def __init__(
        self, reason: str = "retry requested", *, delay: float | dt.timedelta | None = None
    ):
        super().__init__(reason)
        ms = retry_delay_ms(delay)
        self.delay = None if ms is None else ms / 1000


def retry_delay_ms(delay: object) -> int | None:
    """``Retry``'s delay in milliseconds: ``None``, or seconds (a number or a timedelta) from 0
    to ``MAX_RETRY_DELAY_MS`` (30 days), else ``ValueError`` naming it. A date that far off
    would not even be one the server's time plus the delay can name."""
    if delay is None:
        return None
    ms = delay_ms(delay)
    if ms is None:
        raise ValueError(
            f"Retry delay must be a number of seconds from 0 to {MAX_RETRY_DELAY_MS // 1000} "
            f"(30 days), not {delay!r}"
        )
    return ms


class Fail(Exception):
    """Raise from a handler to fail the task at once, for good: no retry."""

    def __init__(self, reason: str = "failed by the handler") -> None:
        super().__init__(reason)


@dataclass
class TaskContext:
    """What a handler may know about its run (docs/handler-context.md lists it)."""

    key: str
    """The task's key (what it was published under, unique in its collection)."""
    name: str
    """The task's name: which handler runs it."""
    attempt: int
    """This run's number among the task's runs, from 1: every claim counts one more (a retry
    after a failure, and a run after a snooze, a back-off, a sleep or a wait)."""
    run_id: str
    """This run's id: the task's runs, its log lines and its steps name it."""
    worker_id: str
    """The worker that runs it (``mtask workers`` lists them)."""
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when the run must stop: cancelled, lease lost, or the worker shutting down. Thread
    handlers can poll ``cancelled.is_set()``."""
    publisher: Callable[..., Awaitable[Any]] | None = None
    """What ``publish`` publishes with (the worker's)."""
    session: Any = None
    """A transactional handler's ``AsyncClientSession``, in the transaction that also records
    the run's SUCCESS (docs/transactions.md); ``None`` for other handlers."""
    lease_lost: bool = False
    """Set by the worker when another run took the task over (this run's outcome will not be
    recorded); ``check_lease`` and ``publish`` then raise ``LeaseLost``."""
    output_for: Callable[[TaskContext], RunOutput] = field(default=lambda _ctx: RunOutput())
    """Makes the run's ``RunOutput`` the first time the handler reports (the worker's writer
    follows it from then on); a run that reports nothing makes none."""
    _output: RunOutput | None = field(default=None, repr=False)
    steps_for: Callable[[TaskContext, Gate], RunSteps] = field(default=lambda c, g: _memory(c, g))
    """Makes the run's journal of durable steps the first time the handler asks for a step,
    sleeps or waits (docs/steps.md), each call step awaiting the gate it is given (its budgets
    and windows of tokens); a run that does none of these makes none."""
    _steps: RunSteps | None = field(default=None, repr=False)
    usage_for: Callable[[TaskContext], RunUsage] = field(default=lambda _ctx: _memory_usage())
    """Makes the run's usage (docs/usage.md) on its first charge or step, if it has one."""
    _usage: RunUsage | None = field(default=None, repr=False)

    @property
    def output_made(self) -> RunOutput | None:
        """The run's ``RunOutput`` if the handler reported anything (else ``None``)."""
        return self._output

    @property
    def output(self) -> RunOutput:
        """The run's live output (docs/output.md): made on first use."""
        if self._output is None:
            with _OUTPUT_LOCK:
                if self._output is None:
                    self._output = self.output_for(self)
        return self._output

    def progress(self, fraction: float | None = None, label: str | None = None) -> None:
        """Say how far the run got: ``fraction`` in [0, 1] and/or a short ``label`` ("step 3
        of 7"). Cheap to call often: the worker writes the newest value a few times a second,
        and the last one before the run's outcome."""
        self.output.progress(fraction, label)

    @property
    def log(self) -> RunLog:
        """Structured log lines kept with the run: ``ctx.log.info("resized", width=640)``;
        ``with ctx.log.capture("myapp"):`` keeps a standard logger's records too."""
        return self.output.log

    def emit(self, data: Any) -> None:
        """Stream a chunk of output (a string, bytes, or any BSON value) to whoever follows
        the task (``client.stream``, SSE, ``mtask logs --follow``), in order, resumably."""
        self.output.emit(data)

    @property
    def steps_made(self) -> RunSteps | None:
        """The run's journal if the handler used a step, a sleep or a wait (else ``None``)."""
        return self._steps

    @property
    def journal(self) -> RunSteps:
        """The run's durable steps (docs/steps.md): made on first use; each checks the budgets."""
        if self._steps is None:
            gate = functools.partial(_checked, self.usage)  # first: the lock is not reentrant
            with _OUTPUT_LOCK:
                if self._steps is None:
                    self._steps = self.steps_for(self, gate)
        return self._steps

    @property
    def usage(self) -> RunUsage:
        """The run's usage and budgets (docs/usage.md): made on first use."""
        with _OUTPUT_LOCK:
            made = self._usage = self._usage or self.usage_for(self)
        return made

    async def record_usage(self, model: str | None = None, **counts: Any) -> Usage:
        """Charge what the run just spent (``input_tokens``, ``output_tokens``, ``cached_tokens``,
        ``requests`` (1), ``cost`` (else priced from ``model``)); docs/usage.md."""
        self.check_lease()
        return await self.usage.record_said(model, counts, _replaying(self._steps))

    def record_usage_sync(self, model: str | None = None, **counts: Any) -> Usage:
        """``record_usage`` for a plain-def handler."""
        self.check_lease()
        return self.usage.record_said_sync(model, counts, _replaying(self._steps))

    def step(
        self,
        name: str,
        fn: Callable[..., Any],
        *args: Any,
        transactional: bool = False,
        policy: StepPolicy | None = None,
        **kwargs: Any,
    ) -> Coroutine[Any, Any, Any]:
        """Call ``fn(*args, **kwargs)`` once per task and record its result (BSON) in the task
        document under ``name``: a later run of the task (a retry, a takeover, a resume after
        a sleep) gets the recorded result back instead of calling it again. ``fn`` may be an
        ``async def``. ``transactional=True``: ``fn`` is an ``async def`` taking ``session=``,
        and its MongoDB writes commit with the step's record. A step that raises is recorded
        failed, and the task's retry policy decides (docs/steps.md). ``policy``: the step's
        own retries, backoff and time limit, spent in place (``StepPolicy``). A name asked for
        again from the same line (a loop) is numbered: ``fetch``, ``fetch#2``, …"""
        return self._step(caller(), name, fn, args, kwargs, transactional, policy)

    async def _step(
        self,
        site: Any,
        name: str,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        transactional: bool,
        policy: StepPolicy | None,
    ) -> Any:
        self.check_lease()
        return await self.journal.step_at(
            site, name, fn, args, kwargs, transactional=transactional, policy=policy
        )

    def step_sync(
        self,
        name: str,
        fn: Callable[..., Any],
        *args: Any,
        policy: StepPolicy | None = None,
        **kwargs: Any,
    ) -> Any:
        """``step`` for a plain-def handler (on its thread or in its child process)."""
        self.check_lease()
        return self.journal.step_sync_at(caller(), name, fn, args, kwargs, policy=policy)

    # -- parallel steps, children, values decided once, patches ----------------------

    async def gather(self, *branches: Awaitable[Any], name: str | None = None) -> list[Any]:
        """Run steps concurrently (``ctx.gather(ctx.step("a", …), ctx.step("b", …))``): each is
        recorded under its own name as it ends, and a later run replays them by name in any
        order, calling only those not recorded (``mtask.steps.parallel``). Their results in
        order."""
        from mtask.steps.parallel import gather

        self.check_lease()
        return await gather(self.journal, branches, name)

    def gather_sync(self, *branches: Callable[[], Any], name: str | None = None) -> list[Any]:
        """``gather`` for a plain-def handler: ``ctx.gather_sync(lambda: ctx.step_sync("a",
        …), …)``, each branch on a thread of its own."""
        from mtask.steps.parallel import gather_sync

        self.check_lease()
        return gather_sync(self.journal, branches, name)

    async def spawn_and_wait(
        self, children: Iterable[Any], *, name: str | None = None
    ) -> list[Any]:
        """Publish ``children`` (``Spawn(name, params)``, or ``(name, params)`` / ``(name, key,
        params)`` tuples) as one recorded step, end the run WAITING without holding a slot,
        and, once the last child finished, return their results in order (``mtask.steps.children``).
        A child that failed for good raises ``ChildFailed`` (which the handler may catch)."""
        from mtask.steps.children import spawn_plan

        self.check_lease()
        return await self.journal.run_plan(spawn_plan(self.journal, self.key, children, name))

    def spawn_and_wait_sync(self, children: Iterable[Any], *, name: str | None = None) -> list[Any]:
        """``spawn_and_wait`` for a plain-def handler."""
        from mtask.steps.children import spawn_plan

        self.check_lease()
        return self.journal.run_plan_sync(spawn_plan(self.journal, self.key, children, name))

    def now(self) -> dt.datetime:
        """The server's time, decided once (on first use) and recorded: a replay gets the same
        time back, so a check made with it takes the same path."""
        return self.journal.now()

    def uuid(self) -> uuid.UUID:
        """A random UUID, decided once and recorded, as ``now``."""
        return self.journal.uuid()

    def patched(self, patch: str) -> bool:
        """``if ctx.patched("v2-ship-first"): new else: old``. ``True`` for a run that has not
        gone past this place before (a new task, or one parked before it); ``False`` for one
        whose journal shows it ran the old code here. The answer is recorded: every later run
        of the task takes the same branch (docs/steps.md)."""
        return self.journal.patched(patch)

    def deprecate_patch(self, patch: str) -> None:
        """What replaces ``patched(patch)`` once no parked task took the old branch: a marker
        recorded here is passed over, none is recorded."""
        self.journal.deprecate_patch(patch)

    def release(self, held: list[Any]) -> None:
        """What a durable step's function said, once the step is recorded (``mtask.steps``)."""
        if held:
            self.output.release(held)

    async def sleep(
        self, duration: float | dt.timedelta | dt.datetime, name: str | None = None
    ) -> None:
        """Sleep ``duration`` seconds (or a timedelta, or until an aware datetime) without
        holding a slot: the run ends as WAITING and the task is claimed again once the
        server's clock passes the end; its recorded steps replay at once. Only returns when
        the sleep is over (a run that resumes returns from it)."""
        self.check_lease()
        await self.journal.sleep(duration, name)

    def sleep_sync(
        self, duration: float | dt.timedelta | dt.datetime, name: str | None = None
    ) -> None:
        """``sleep`` for a plain-def handler."""
        self.check_lease()
        self.journal.sleep_sync(duration, name)

    async def wait_for(
        self,
        signal: str,
        timeout: float | dt.timedelta | None = None,  # noqa: ASYNC109 - durable, server clock
        name: str | None = None,
    ) -> Any:
        """The payload of signal ``signal`` (``client.signal(key, signal, payload)``): at once
        if it was sent, even before this wait began; else the run ends as WAITING and the task
        is claimed again when it comes. After ``timeout`` seconds without it (on the server's
        clock): ``SignalTimeout``, which the handler may catch."""
        self.check_lease()
        return await self.journal.wait_for(signal, timeout, name)

    def wait_for_sync(
        self, signal: str, timeout: float | dt.timedelta | None = None, name: str | None = None
    ) -> Any:
        """``wait_for`` for a plain-def handler."""
        self.check_lease()
        return self.journal.wait_for_sync(signal, timeout, name)

    async def wait_until(
        self,
        collection: str,
        predicate: Mapping[str, Any],
        timeout: float | dt.timedelta | None = None,  # noqa: ASYNC109 - durable, server clock
        name: str | None = None,
    ) -> Any:
        """The document of ``collection`` that ``predicate`` (a find filter naming the
        document's ``_id``) matches: at once if it does now; else the run ends as WAITING (no
        slot held) and the task is claimed again when a change to that document makes it match
        (docs/triggers.md; the registry ``waits_on`` the collection). After ``timeout``
        seconds without it (the server's clock): ``ConditionTimeout``, which the handler may
        catch."""
        self.check_lease()
        return await self.journal.wait_until(collection, predicate, timeout, name)

    def wait_until_sync(
        self,
        collection: str,
        predicate: Mapping[str, Any],
        timeout: float | dt.timedelta | None = None,
        name: str | None = None,
    ) -> Any:
        """``wait_until`` for a plain-def handler."""
        self.check_lease()
        return self.journal.wait_until_sync(collection, predicate, timeout, name)

    def continue_as_new(self, params: Mapping[str, Any]) -> NoReturn:
        """End this run and start the task afresh with ``params`` and a new journal: same key,
        same place in its group, its retries unspent; the journal it leaves is summarised in
        the task's ``continued`` (docs/steps.md, "Loops without end"). Never returns."""
        self.check_lease()
        self.journal.continue_as_new(params)

    def check_lease(self) -> None:
        """Raise ``LeaseLost`` if this run no longer owns its task: a plain-def handler (which
        the worker cannot interrupt) calls it between steps to stop doing a zombie's work."""
        if self.lease_lost:
            raise LeaseLost(f"run {self.run_id} of {self.key!r} lost its lease")

    async def publish(self, name: str, key: str, params: Any = None, **kwargs: Any) -> Any:
        """Publish a follow-up task (idempotent by key, like any publish). Raises
        ``LeaseLost`` once the run lost its task: a follow-up is the owner's to publish."""
        self.check_lease()
        if self.publisher is None:
            raise MtaskError("this context cannot publish")
        return await self.publisher(name, key, params, **kwargs)


def _memory(ctx: TaskContext, gate: Gate) -> RunSteps:
    """A run's journal in memory (a context made outside a worker)."""
    return RunSteps(
        MemorySteps(), [], run_id=ctx.run_id, attempt=ctx.attempt, release=ctx.release, gate=gate
    )


def _memory_usage() -> RunUsage:
    from mtask.usage.charges import MemoryUsage, RunUsage

    return RunUsage(MemoryUsage())


def _replaying(steps: RunSteps | None) -> bool:
    """Whether a charge said here was made by an earlier run: outside a step's function, while
    the run replays steps an earlier run recorded past this point (docs/usage.md)."""
    from mtask.steps.plan import IN_STEP

    return steps is not None and IN_STEP.get() is None and steps.journal.replaying()


async def _checked(usage: RunUsage) -> None:
    """Before a step starts: its budgets checked (``RunUsage.check``); past one without a
    period, ``BudgetExceeded``."""
    from mtask.usage.charges import BudgetSpent

    try:
        await usage.check()
    except BudgetSpent as spent:
        raise BudgetExceeded(spent.budget, spent.limit, spent.spent) from None


class BudgetExceeded(Fail):
    """A step would have started past a budget (docs/usage.md): the task fails for good, naming
    the budget (``budget``: ``"task"``, ``"name '<name>'"`` or ``"group '<group>'"``)."""

    def __init__(self, budget: str, limit: Budget, spent: Mapping[str, Any]) -> None:
        from mtask.usage.rules import from_nanos

        tokens = int(spent.get("input_tokens") or 0) + int(spent.get("output_tokens") or 0)
        cost = from_nanos(spent.get("cost_nanos"))
        shown = f"{tokens} tokens" + ("" if cost is None else f", a cost of {cost.normalize():f}")
        super().__init__(
            f"budget exceeded: the {budget} budget of {limit.describe()} ({shown} spent)"
        )
        self.budget = budget
        self.limit = limit


@dataclass(frozen=True)
class BatchItem:
    """One task of a batch: its key, its params (as stored) and its run's context."""

    key: str
    params: dict[str, Any]
    ctx: TaskContext


MAX_UNITS = 1000
"""The most units of a limit one run may take (``@registry.task(units=…)``)."""


@dataclass(frozen=True)
class Handler:
    name: str
    fn: Callable[..., Any]
    is_async: bool
    params_model: type[BaseModel] | None
    wants_context: bool
    transactional: bool = False
    # -- handler declarations --
    options: Mapping[str, Any] = field(default_factory=dict)
    """Options a publish of this name gets when it does not give them (explicitly set fields
    of the declared ``TaskOptions`` only)."""
    isolation: Isolation | None = None
    """``"process"``: a plain-def handler runs in a child process; ``None``: the worker's pool."""
    time_limit: float | None = None
    """Hard limit in seconds: the run is ended (child killed, task cancelled, thread abandoned)
    and recorded FAIL ``time limit exceeded``."""
    soft_time_limit: float | None = None
    """Soft limit in seconds: ``ctx.cancelled`` is set, the handler may still end on its own."""
    batch: int | None = None
    """A batch handler's most tasks per call (``mtask.limits.batches``); ``None``: one."""
    batch_timeout: float = DEFAULT_BATCH_TIMEOUT
    """The longest the first task of a batch waits for the batch to fill."""
    uses: tuple[str, ...] = ()
    """The shared resources its runs take a slot of (``set_limit(resource=…)``)."""
    units: int = 1
    """How many units of each limit its runs take (their concurrency and their rate's tokens)."""

    def parse(self, params: Mapping[str, Any]) -> Any:
        if self.params_model is None:
            return dict(params)
        from pydantic import ValidationError  # loaded: the handler's model is one

        from mtask.models import describe_validation_error

        try:
            return self.params_model.model_validate(params)
        except ValidationError as exc:
            raise InvalidParams(
                f"params do not match {self.params_model.__name__}: "
                + describe_validation_error(exc, prefix="params")
            ) from None

    def args(self, params: Any, ctx: TaskContext) -> tuple[Any, ...]:
        return (params, ctx) if self.wants_context else (params,)


def _inspect(fn: Callable[..., Any]) -> tuple[type[BaseModel] | None, bool]:
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # noqa: BLE001 - unresolvable annotations: treat as unannotated
        hints = {}
    params = list(inspect.signature(fn).parameters.values())
    if not params or len(params) > 2:
        raise InvalidTask(
            f"handler {fn.__qualname__} must take (params) or (params, ctx), "
            f"not {len(params)} parameters"
        )
    model = hints.get(params[0].name)
    # a params model exists only if some module imported pydantic already: a registry whose
    # handlers take plain dicts loads none (a worker's start: test_lazy_imports.py)
    pydantic = sys.modules.get("pydantic")
    base = None if pydantic is None else pydantic.BaseModel
    params_model = (
        model if base is not None and isinstance(model, type) and issubclass(model, base) else None
    )
    return params_model, len(params) == 2


def _declarations(
    options: TaskOptions | Mapping[str, Any] | None,
    isolation: str | None,
    time_limit: float | None,
    soft_time_limit: float | None,
) -> dict[str, Any]:
    """Check a handler's declarations; bad ones are ``InvalidTask`` at import time."""
    if isolation is not None and isolation not in ISOLATIONS:
        raise InvalidTask(f"must be one of {', '.join(ISOLATIONS)}", field="isolation")
    for label, limit in (("time_limit", time_limit), ("soft_time_limit", soft_time_limit)):
        if limit is not None and (isinstance(limit, bool) or not limit > 0):
            raise InvalidTask("must be a positive number of seconds", field=label)
    if time_limit is not None and soft_time_limit is not None and soft_time_limit > time_limit:
        raise InvalidTask("must not exceed time_limit", field="soft_time_limit")
    defaults: dict[str, Any] = {}
    if options:  # nothing declared: nothing to check (nor pydantic to load)
        from mtask.models import explicit_options

        defaults = explicit_options(options)
    for fixed in ("run_at", "deadline"):
        if fixed in defaults:
            raise InvalidTask("a handler default cannot be a fixed time", field=f"options.{fixed}")
    return {
        "options": defaults,
        "isolation": isolation,
        "time_limit": time_limit,
        "soft_time_limit": soft_time_limit,
    }


class Registry:
    """Maps task names to handlers."""

    def __init__(self) -> None:
        self.handlers: dict[str, Handler] = {}
        self.schedules: dict[str, Schedule] = {}
        self.triggers: dict[str, Trigger] = {}
        self.watched: tuple[str, ...] = ()
        """The collections whose documents this registry's handlers wait on
        (``ctx.wait_until``; ``waits_on``)."""
        self.prices: dict[str, Price] = {}
        """Each model's price (``price``): a charge without a cost is priced from it."""

    def price(
        self,
        model: str,
        *,
        input: float,
        output: float,
        cached: float | None = None,
        per: int = 1_000_000,
    ) -> Price:
        """Declare ``model``'s price, in the application's currency per ``per`` tokens (input,
        output, and input read from the cache; docs/usage.md): each charge of it recorded
        without a cost (``ctx.record_usage``, an agent's model step) is priced with it."""
        from mtask.usage.rules import Price

        try:
            made = Price(input, output, cached, per)
        except ValueError as exc:
            raise InvalidTask(str(exc), field="price") from None
        if not isinstance(model, str) or not model:
            raise InvalidTask("a model's name is a non-empty string", field="model")
        self.prices[model] = made
        return made

    def trigger(self, collection: str, *, task: str, **declaration: Any) -> Trigger:
        """Publish a ``task`` task for each matching change of ``collection`` (docs/triggers.md):
        ``match`` (field conditions on the changed document), ``on`` (insert, update, replace,
        delete), ``fields`` (updates that touched one of them), ``params`` (fields copied into
        the task's params), ``key`` (``"change"``: a task per change; ``"document"``: one per
        document), ``debounce`` (seconds after a document's latest change), ``start``
        (``"now"``, or ``"scan"`` the matching documents once first), ``images`` (match the
        document as the change left it), ``options``, and ``name`` (the task's name unless
        given). Workers running this registry follow it: one of them for the whole cluster."""
        trigger = Trigger.build(collection, task=task, **declaration)
        if trigger.name in self.triggers:
            raise InvalidTask(f"a trigger {trigger.name!r} is already declared", field="name")
        self.triggers[trigger.name] = trigger
        return trigger

    def waits_on(self, *collections: str) -> None:
        """Handlers of this registry wait on documents of these collections
        (``ctx.wait_until``): workers running it follow each of them, one of them for the whole
        cluster, and wake the tasks a change may settle (docs/triggers.md)."""
        names = [check_collection(c) for c in collections]
        self.watched = tuple(dict.fromkeys((*self.watched, *names)))

    def schedule(self, task: str, *, id: str | None = None, **definition: Any) -> Schedule:
        """Publish a ``task`` task on each tick of ``cron=`` or ``every=`` (and ``timezone``,
        ``params``, ``options``, ``catch_up``, ``misfire_grace_s``: see ``Schedule.build``).
        Workers running this registry create (or update) the schedule in MongoDB when they
        start; the schedule's id is ``id`` or the task name."""
        from mtask.schedules.definition import (
            Schedule,  # its model: loaded by a registry that has one
        )

        schedule = Schedule.build(id or task, task, **definition)
        if schedule.id in self.schedules:
            raise InvalidTask(f"a schedule {schedule.id!r} is already declared", field="id")
        self.schedules[schedule.id] = schedule
        return schedule

    def task(
        self,
        name: str | None = None,
        *,
        transactional: bool = False,
        # -- handler declarations --
        options: TaskOptions | Mapping[str, Any] | None = None,
        isolation: Isolation | None = None,
        time_limit: float | None = None,
        soft_time_limit: float | None = None,
        batch: int | None = None,
        batch_timeout: float | None = None,
        uses: Sequence[str] = (),
        units: int = 1,
    ) -> Callable[[F], F]:
        """Register a handler. ``transactional``: an ``async def`` handler taking ``ctx``
        writes with ``ctx.session``, and those writes commit with the run's SUCCESS
        (docs/transactions.md). ``options``: defaults a publish of this name gets for the
        options it does not give (publish options > handler defaults > global defaults; applied
        by a ``TaskClient`` given this registry). ``isolation="process"`` runs a plain-def
        handler in a child process. ``soft_time_limit``/``time_limit`` (seconds, Celery's
        names): the run's cooperative and hard limits. ``uses``: the shared resources its runs
        count against (an API quota shared by several names: ``set_limit(resource=…)``); a
        resource with no limit set limits nothing. ``units``: how many units of each limit a
        run takes (a costly call: 5 of a resource's 10 at once, 5 of its tokens). ``batch``:
        the handler takes a list of up to that many ``BatchItem`` and answers one entry each
        (``mtask.limits.batches``), called once the batch is full or ``batch_timeout``
        seconds after its first task (default 1; only with ``batch``)."""
        declared = _declarations(options, isolation, time_limit, soft_time_limit)
        resources = _resources(uses, units)
        if batch is None and batch_timeout is not None:
            raise InvalidTask(
                "only with batch=…: a handler without one is called for each task",
                field="batch_timeout",
            )
        if batch is not None:
            timeout = DEFAULT_BATCH_TIMEOUT if batch_timeout is None else batch_timeout
            declared["batch"], declared["batch_timeout"] = check_batch(batch, timeout)
            if transactional or isolation is not None or time_limit or soft_time_limit:
                raise InvalidTask(
                    "a batch handler cannot be transactional, isolated or time-limited",
                    field="batch",
                )

        def register(fn: F) -> F:
            task_name = name or fn.__name__
            if task_name in self.handlers:
                raise InvalidTask(f"a handler for {task_name!r} is already registered")
            if batch is not None:  # one argument: the items
                if len(inspect.signature(fn).parameters) != 1:
                    raise InvalidTask(
                        f"batch handler {fn.__qualname__} must take one argument, its items",
                        field="batch",
                    )
                params_model, wants_context = None, False
            else:
                params_model, wants_context = _inspect(fn)
            if transactional and not (inspect.iscoroutinefunction(fn) and wants_context):
                raise InvalidTask(
                    f"transactional handler {fn.__qualname__} must be an async def taking "
                    "(params, ctx): it writes with ctx.session, an AsyncClientSession"
                )
            if declared["isolation"] == "process" and (
                inspect.iscoroutinefunction(fn) or "<locals>" in fn.__qualname__
            ):
                raise InvalidTask(
                    f"handler {task_name!r}: isolation='process' needs a plain def handler "
                    "defined at module level (a child process imports it by name)",
                    field="isolation",
                )
            self.handlers[task_name] = Handler(
                name=task_name,
                fn=fn,
                is_async=inspect.iscoroutinefunction(fn),
                params_model=params_model,
                wants_context=wants_context,
                transactional=transactional,
                uses=resources,
                units=units,
                **declared,
            )
            return fn

        return register

    @property
    def names(self) -> list[str]:
        return sorted(self.handlers)

    @property
    def units(self) -> dict[str, int]:
        """How many units of each limit each name's runs take (names that take more than one)."""
        return {n: h.units for n, h in self.handlers.items() if h.units != 1}

    @property
    def uses(self) -> dict[str, tuple[str, ...]]:
        """The shared resources each name's runs take a slot of (names that use one)."""
        return {n: h.uses for n, h in self.handlers.items() if h.uses}

    def options_for(
        self, name: str, options: TaskOptions | Mapping[str, Any] | None
    ) -> TaskOptions | Mapping[str, Any] | None:
        """``options`` completed with the handler's declared defaults (publish options win)."""
        handler = self.handlers.get(name)
        if handler is None or not handler.options:
            return options
        from mtask.models import TaskOptions  # loaded: the handler declared its options

        if isinstance(options, TaskOptions):
            given = options.model_dump(include=options.model_fields_set)
        else:
            given = dict(options or {})
        return {**handler.options, **given}

    def __getitem__(self, name: str) -> Handler:
        return self.handlers[name]

    def __contains__(self, name: object) -> bool:
        return name in self.handlers

    def __iter__(self) -> Iterator[str]:
        """The registered names, sorted (as ``names``): ``list(registry)`` lists them. Without
        it, Python iterated through ``__getitem__`` with 0, 1, … and raised ``KeyError: 0``."""
        return iter(self.names)


def load_registry(spec: str) -> Registry:
    """The ``Registry`` that ``module:attribute`` names (``module`` alone: its one registry),
    imported as ``python -m`` would, from the current directory too (``mtask-worker``,
    ``mtask step check``). ``RegistryNotFound`` says why not."""
    module_name, _, attr = spec.partition(":")
    if not module_name:
        raise RegistryNotFound(f"expected module:registry, got {spec!r}")
    if "" not in sys.path and "." not in sys.path:
        sys.path.insert(0, "")  # like python -m: modules in the current directory
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise RegistryNotFound(f"cannot import {module_name!r}: {exc}") from None
    if attr:
        registry = getattr(module, attr, None)
    else:
        found = [v for v in vars(module).values() if isinstance(v, Registry)]
        registry = found[0] if len(found) == 1 else None
    if not isinstance(registry, Registry):
        raise RegistryNotFound(f"{spec!r} is not an mtask.Registry")
    return registry


def _resources(uses: object, units: object) -> tuple[str, ...]:
    """A handler's ``uses`` checked, each resource once, and its ``units`` checked. ``None`` is
    refused as ``units=None`` is: no resources is ``[]``, the default."""
    if isinstance(uses, str) or not isinstance(uses, Iterable):
        given = (
            "a string" if isinstance(uses, str) else "None" if uses is None else type(uses).__name__
        )
        raise InvalidTask(
            f"must be a list of resource names ([] for none), not {given}", field="uses"
        )
    from mtask.limits.rules import validate_resource

    resources = tuple(dict.fromkeys(validate_resource(r) for r in uses))
    if isinstance(units, bool) or not isinstance(units, int) or not 1 <= units <= MAX_UNITS:
        raise InvalidTask(f"must be an integer from 1 to {MAX_UNITS}", field="units")
    return resources
