"""The worker's side of usage (docs/usage.md): each run's ``UsageStore`` on MongoDB
(``TaskUsage``), made the first time its handler records usage or takes a step
(``RunUsages.usage_for``), so a handler that does neither costs nothing; the budgets of names
and groups, cached a few seconds (``Budgets``: nothing per scope while no budget exists); the
Prometheus counters.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from mtask import metrics
from mtask.clock import Clock
from mtask.driver import AsyncDriver, Doc
from mtask.store import slots
from mtask.store import usage as store_usage
from mtask.usage.charges import RunUsage
from mtask.usage.rules import Price, Usage

if TYPE_CHECKING:
    from mtask.registry import TaskContext

BUDGETS_TTL = 5.0
"""How long a worker trusts what it read of whether any budget exists, and of a scope's budget
(a budget set, changed or cleared takes effect on the next read, within this many seconds)."""


class Budgets:
    """Which scopes have a budget. First whether any scope has one, read at most once every
    ``BUDGETS_TTL`` seconds for the whole worker (its index created before the first read):
    while none has, nothing more is read, however many names and groups the runs charge. Once
    some have, which of a run's scopes have one, read at most once every ``BUDGETS_TTL``
    seconds per scope. Both by the process's monotonic clock: only how stale the cache may
    be."""

    def __init__(self, driver: AsyncDriver, ttl: float = BUDGETS_TTL) -> None:
        self.driver = driver
        self.ttl = ttl
        self.known: dict[tuple[str, str], tuple[float, bool]] = {}
        self.anywhere: tuple[float, bool] | None = None
        """When it was last read whether any scope has a budget, and the answer."""
        self.lock = asyncio.Lock()
        """Held while that is read: runs asking at once wait for one read."""
        self.indexed = False

    async def any_of(self, scopes: list[Doc]) -> bool:
        if not await self._any():
            return False
        now = time.monotonic()
        keys = [(s["scope"], s["id"]) for s in scopes]
        stale = [s for s, k in zip(scopes, keys, strict=True) if not self._fresh(k, now)]
        if stale:
            found = await self.driver.run(store_usage.budgets_of(stale))
            with_budget = {(d["_id"]["scope"], d["_id"]["id"]) for d in found}
            for scope in stale:
                key = (scope["scope"], scope["id"])
                self.known[key] = (now, key in with_budget)
        return any(self.known[k][1] for k in keys)

    async def _any(self) -> bool:
        """Whether any scope has a budget, as last read (again once ``ttl`` passed)."""
        async with self.lock:
            now = time.monotonic()
            if self.anywhere is None or now - self.anywhere[0] >= self.ttl:
                if not self.indexed:
                    await self.driver.run(store_usage.ensure_indexes())
                    self.indexed = True
                self.anywhere = (now, await self.driver.run(store_usage.any_budget()))
            return self.anywhere[1]

    def _fresh(self, key: tuple[str, str], now: float) -> bool:
        seen = self.known.get(key)
        return seen is not None and now - seen[0] < self.ttl


class TaskUsage:
    """One run's ``UsageStore``: its task, run, name and group."""

    def __init__(
        self,
        driver: AsyncDriver,
        clock: Clock,
        budgets: Budgets,
        key: str,
        run_id: str,
        name: str,
        group: str | None,
        resources: tuple[str, ...] = (),
    ) -> None:
        self.driver = driver
        self.resources = resources
        """The slots of the shared resources with a limit in tokens the run's name takes."""
        self.clock = clock
        self.budgets = budgets
        self.key = key
        self.run_id = run_id
        self.scopes = [store_usage.scope_id("name", name)]
        if group:
            self.scopes.append(store_usage.scope_id("group", group))

    def now(self) -> dt.datetime:
        return self.clock.now()

    async def charge(self, usage: Usage) -> None:
        if self.resources:  # first: the provider counted these tokens, whatever the run's fate
            await self.driver.run(slots.charge_measured(self.resources, usage.tokens))
        await self.driver.run(store_usage.charge_task(self.key, self.run_id, usage))
        await self.driver.run(store_usage.charge_scopes(self.scopes, usage))

    async def budgeted(self) -> bool:
        return await self.budgets.any_of(self.scopes)

    async def over(self) -> list[Doc]:
        return await self.driver.run(store_usage.over_budget(self.scopes))

    async def admit(self) -> tuple[float, str] | None:
        if not self.resources:  # a name that takes no resource limited in tokens: no read
            return None
        return await self.driver.run(slots.admit_measured(self.resources, self.clock.now()))


def counted(name: str) -> Any:
    """The Prometheus counters a charge of task name ``name`` adds to."""

    def count(usage: Usage) -> None:
        model = usage.model or metrics.UNKNOWN
        for kind in ("input", "output", "cached"):
            amount = getattr(usage, f"{kind}_tokens")
            if amount:
                metrics.TOKENS.labels(name=name, model=model, kind=kind).inc(amount)
        if usage.cost_nanos:  # Prometheus counts in floating point: its sums are approximate
            metrics.COST.labels(name=name, model=model).inc(usage.cost_nanos / 1e9)

    return count


class RunUsages:
    """Makes each run's ``RunUsage`` on first use (``TaskContext.usage_for``)."""

    def __init__(
        self,
        driver: AsyncDriver,
        clock: Clock,
        prices: Mapping[str, Price] | None = None,
        measured: Callable[[str], tuple[str, ...]] | None = None,
    ) -> None:
        self.driver = driver
        self.measured = measured
        """The slots of the resources with a limit in tokens a name's runs take (the gate's)."""
        self.clock = clock
        self.prices = dict(prices or {})
        self.budgets = Budgets(driver)

    def usage_for(
        self, ctx: TaskContext, *, doc: Mapping[str, Any], loop: asyncio.AbstractEventLoop
    ) -> RunUsage:
        options = doc.get("options") or {}
        store = TaskUsage(
            self.driver,
            self.clock,
            self.budgets,
            ctx.key,
            ctx.run_id,
            ctx.name,
            options.get("group"),
            () if self.measured is None else self.measured(ctx.name),
        )
        return RunUsage(
            store,
            prices=self.prices,
            budget=options.get("budget"),
            spent=doc.get("usage"),
            counted=counted(ctx.name),
            loop=loop,
        )
