"""One run's usage (``RunUsage``): ``ctx.record_usage`` charges through a ``UsageStore``
(the worker's, ``mtask.worker.running.usage_stores``; ``MemoryUsage`` for tests), and a step
checks the budgets before it starts, then asks the windows of the resources limited in tokens
the run takes to admit it (``check``: the run's durable steps call it, ``mtask.steps.calls``).

A task's own budget is checked here, against what its task spent: one run at a time owns the
task, and only the owner's fenced charges change its total, so the run's count is the
server's. A name's or group's budget is checked on the server (``UsageStore.over``), whose
totals every worker's charges add to.
"""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import Callable, Coroutine, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from mtask.errors import InvalidTask, MtaskError
from mtask.limits.snooze import Snooze
from mtask.usage.rules import Price, Usage, next_period
from mtask.vocabulary import MAX_RETRY_DELAY_MS

if TYPE_CHECKING:
    from mtask.models import Budget

Doc = dict[str, Any]

IN_PLACE_S = 1.0
"""A step refused by a window of tokens that ends within this many seconds waits for it in
place; one that ends later snoozes its run (``RunUsage.admitted``)."""
IN_PLACE_TRIES = 3
"""How many waits in place a step makes before its run snoozes (each one until a window's
end: a refusal after one is another worker's step admitted first)."""


class UsageStore(Protocol):
    """Where a run's charges go, and where its name's and group's budgets are read."""

    def now(self) -> dt.datetime:
        """The server's time, as this process estimates it."""
        ...

    async def charge(self, usage: Usage) -> None:
        """Charge ``usage`` to the run's task (fenced: ``LeaseLost`` if the run lost it), then
        to its name and its group."""
        ...

    async def budgeted(self) -> bool:
        """Whether the run's name or group has a budget (cached by the worker a few seconds:
        a run whose name and group have none reads nothing per step)."""
        ...

    async def over(self) -> list[Doc]:
        """The run's name's and group's scopes at or past their budget now (the server
        decides, on its clock)."""
        ...

    async def admit(self) -> tuple[float, str] | None:
        """Admit a step on the shared resources limited in tokens the run takes (the server
        decides, on its clock): ``None`` if admitted (or none), else the seconds until the
        window that refused it ends, and what to say of it (the resource and its window)."""
        ...


class MemoryUsage:
    """A ``UsageStore`` in memory (``mtask.testing``, a dry replay): charges kept in a list,
    no budget but the task's."""

    def __init__(self, clock: Callable[[], dt.datetime] | None = None) -> None:
        self.charged: list[Usage] = []
        self.clock = clock or (lambda: dt.datetime.now(dt.UTC))

    def now(self) -> dt.datetime:
        return self.clock()

    async def charge(self, usage: Usage) -> None:
        self.charged.append(usage)

    async def budgeted(self) -> bool:
        return False

    async def over(self) -> list[Doc]:
        return []

    async def admit(self) -> tuple[float, str] | None:
        return None


class BudgetSpent(MtaskError):
    """A step would start past a budget (``budget``: ``"task"``, ``"name 'n'"``, ``"group
    'g'"``): the run's durable steps raise ``mtask.BudgetExceeded`` for it."""

    def __init__(self, budget: str, limit: Budget, spent: Mapping[str, Any]) -> None:
        super().__init__(budget)
        self.budget, self.limit, self.spent = budget, limit, spent

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled whole: a child process's step raises it as the worker found it."""
        return (type(self), (self.budget, self.limit, dict(self.spent)))


def said(model: str | None, counts: Mapping[str, Any]) -> Usage:
    """A charge as a handler said it; ``InvalidTask`` naming what is wrong with it."""
    try:
        return Usage.of(model, **counts)
    except (TypeError, ValueError) as exc:
        raise InvalidTask(f"ctx.record_usage: {exc}") from None


class RunUsage:
    """One run's usage: its ``store``, the application's ``prices``, the task's ``budget``
    (``options.budget``) and what the task had ``spent`` when claimed; ``counted`` is called
    with each charge once recorded (the worker's Prometheus counters); ``loop`` is where a
    plain-def handler's charge is written."""

    def __init__(
        self,
        store: UsageStore,
        *,
        prices: Mapping[str, Price] | None = None,
        budget: Mapping[str, Any] | None = None,
        spent: Mapping[str, Any] | None = None,
        counted: Callable[[Usage], None] | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        self.store = store
        self.prices = dict(prices or {})
        self.budget: Budget | None = None
        if budget:  # the model (pydantic) imported by a task that has a budget, not by each run
            from mtask.models import Budget

            self.budget = Budget.model_validate(dict(budget))
        spent = spent or {}
        self.tokens = int(spent.get("input_tokens") or 0) + int(spent.get("output_tokens") or 0)
        self.cost_nanos = int(spent.get("cost_nanos") or 0)
        self.counted = counted
        self.loop = loop
        self.recorded: list[Usage] = []
        """The charges this run recorded, in order."""

    async def record_said(
        self, model: str | None, counts: Mapping[str, Any], replaying: bool
    ) -> Usage:
        """``ctx.record_usage``: a charge from what the handler said, recorded (priced only,
        ``replaying``: an earlier run recorded it)."""
        usage = said(model, counts)
        return usage.priced(self.prices) if replaying else await self.record(usage)

    def record_said_sync(
        self, model: str | None, counts: Mapping[str, Any], replaying: bool
    ) -> Usage:
        usage = said(model, counts)
        return usage.priced(self.prices) if replaying else self.record_sync(usage)

    async def record(self, usage: Usage) -> Usage:
        """Charge ``usage`` (priced from the application's table when it has no cost)."""
        usage = usage.priced(self.prices)
        await self.store.charge(usage)
        self.tokens += usage.tokens
        self.cost_nanos += usage.cost_nanos or 0
        self.recorded.append(usage)
        if self.counted is not None:
            self.counted(usage)
        return usage

    def record_sync(self, usage: Usage) -> Usage:
        """``record`` from a plain-def handler's thread (its write runs on the loop)."""
        return self._blocking(self.record(usage))

    def _blocking(self, coro: Coroutine[Any, Any, Usage]) -> Usage:
        if self.loop is None:
            return asyncio.run(coro)
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    async def check(self) -> None:
        """Before a step starts: ``BudgetSpent`` past the task's budget or a name's or
        group's budget without a period; ``Snooze`` until the next period past one with."""
        budget = self.budget
        if budget is not None and (
            (budget.tokens is not None and self.tokens >= budget.tokens)
            or (budget.cost is not None and self.cost_nanos >= (budget.cost_nanos() or 0))
        ):
            cost = self.cost_nanos if budget.cost is not None else None
            spent = {"input_tokens": self.tokens, "cost_nanos": cost}
            raise BudgetSpent("task", budget, spent)
        if await self.store.budgeted():
            over = await self.store.over()
            if over:
                raise self.stopped(over)
        await self.admitted()

    async def admitted(self) -> None:
        """Before a step starts, after its budgets: admitted by the windows of the resources
        limited in tokens the run takes (``UsageStore.admit``). A window that ends within
        ``IN_PLACE_S`` is waited for in place (a snooze, a new claim and the replay of the
        run's steps cost more than that); one that ends later, or a third refusal in a row,
        snoozes the run until the window's end: it holds no slot meanwhile, and spends no
        try (``Snooze``)."""
        for _ in range(IN_PLACE_TRIES):
            refused = await self.store.admit()
            if refused is None:
                return
            if refused[0] > IN_PLACE_S:
                break
            await asyncio.sleep(refused[0])
        else:
            refused = await self.store.admit()
            if refused is None:
                return
        wait, said = refused
        wait = min(wait, MAX_RETRY_DELAY_MS / 1000)
        raise Snooze(wait, f"waiting for the next window of tokens of {said}")

    def stopped(self, over: list[Doc]) -> Exception:
        """Why a step does not start: the first scope past its budget without a period
        (``BudgetSpent``); if all have one, a ``Snooze`` until the latest next period."""
        from mtask.models import Budget

        until: dt.datetime | None = None
        for doc in over:
            scope = doc["_id"]
            limit = Budget.model_validate(
                {k: v for k, v in doc["budget"].items() if k != "cost_nanos"}
            )
            label = f"{scope['scope']} {scope['id']!r}"
            if limit.period is None:
                return BudgetSpent(label, limit, doc)
            ends = next_period(limit.period, self.store.now())
            until = ends if until is None or ends > until else until
        assert until is not None
        wait = (until - self.store.now()).total_seconds()
        wait = min(max(wait, 0.001), MAX_RETRY_DELAY_MS / 1000)
        return Snooze(wait, "budget spent for this period: waiting for the next")
