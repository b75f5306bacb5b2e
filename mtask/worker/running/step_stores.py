"""The worker's side of durable steps (docs/steps.md): each run's ``StepStore`` on MongoDB.

``RunStepStores`` is the ``RunJournals`` the runs' contexts are built with
(``context.RunContexts``); ``steps_for`` makes a run's ``RunSteps`` (``mtask.steps``) the first
time its handler asks for a step, sleeps or waits, so a handler that does none of these costs
nothing. Every write goes through ``store.steps``, fenced by the run; a transactional step's
function and its record commit in one transaction (``running.transactional.transact``, with
the run's ``RunFence``).
"""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import Callable, Collection, Coroutine, Mapping
from typing import Any

from mtask.clock import Clock
from mtask.driver import AsyncDriver, Doc, Op
from mtask.errors import ConfigError
from mtask.registry import TaskContext
from mtask.steps import RunSteps, StepError
from mtask.steps.calls import Gate
from mtask.store import children as store_children
from mtask.store import datawaits
from mtask.store import steps as store_steps
from mtask.store.output import keep_until
from mtask.tracing import step_tracer
from mtask.worker.running.transactional import RunFence, Transactions


class TaskSteps:
    """One run's ``StepStore``: its task, run and retention; the worker's driver and clock."""

    def __init__(
        self,
        driver: AsyncDriver,
        clock: Clock,
        key: str,
        run_id: str,
        options: Mapping[str, Any],
        transactions: Transactions | None,
        fence: Callable[[], RunFence],
        indexes: Callable[[], Coroutine[Any, Any, None]],
        watched: Collection[str] = (),
        options_for: store_children.OptionsFor | None = None,
    ) -> None:
        self.watched = watched
        """The collections the registry waits on (``ctx.wait_until``)."""
        self.driver = driver
        self.clock = clock
        self.key = key
        self.run_id = run_id
        self.options = options
        self.transactions = transactions
        self.fence = fence
        self.indexes = indexes
        self.options_for = options_for
        """The declared defaults of a child's name (``Registry.options_for``)."""

    def now(self) -> dt.datetime:
        return self.clock.now()

    async def record(self, index: int, entry: Doc, prior: Doc | None) -> None:
        await self.driver.run(store_steps.record(self.key, self.run_id, index, entry, prior))

    def _spill(self, data: bytes) -> Op[Doc]:
        expire = keep_until(self.options, self.clock.now())
        ref: Doc = yield from store_steps.spill(self.key, data, expire)
        return ref

    async def spill(self, data: bytes) -> Doc:
        await self.indexes()
        return await self.driver.run(self._spill(data))

    async def load(self, spill: Mapping[str, Any]) -> bytes:
        return await self.driver.run(store_steps.load(self.key, spill))

    async def signals(self, name: str) -> list[Doc]:
        return await self.driver.run(store_steps.signals(self.key, name))

    async def holds(self, collection: str, predicate: Doc, waiting: Doc | None) -> Doc | None:
        if collection not in self.watched:
            raise StepError(
                f"ctx.wait_until({collection!r}, …): the registry does not wait on it; declare "
                f"registry.waits_on({collection!r}) so that its workers follow it"
            )
        if waiting is not None:
            await self.driver.run(datawaits.announce(self.key, self.run_id, waiting))
        return await self.driver.run(datawaits.find(collection, predicate))

    # -- workflows ---------------------------------------------------------------------------

    async def record_named(self, entry: Doc, prior: Doc | None) -> None:
        await self.driver.run(store_steps.record_named(self.key, self.run_id, entry, prior))

    async def spawn(self, index: int, entry: Doc, children: list[Doc]) -> None:
        await self.driver.run(
            store_children.spawn(
                self.key, self.run_id, index, entry, children, self.clock.now(), self.options_for
            )
        )

    async def publish(self, step: str, children: list[Doc]) -> None:
        now = self.clock.now()
        await self.driver.run(
            store_children.publish(self.key, step, children, now, self.options_for)
        )

    async def children(self, step: str) -> list[Doc]:
        return await self.driver.run(store_children.children(self.key, step))

    async def transact(
        self,
        fn: Callable[[Any], Coroutine[Any, Any, Any]],
        entry_for: Callable[[Any], tuple[Doc, bytes | None]],
        index: int,
        prior: Doc | None,
    ) -> Any:
        if self.transactions is None:
            raise ConfigError("a transactional step needs the worker's MongoDB client")
        await self.indexes()  # never built inside a transaction (docs/transactions.md)

        def write(result: Any) -> Op[Doc | None]:
            entry, data = entry_for(result)
            if data is not None:
                entry["spill"] = yield from self._spill(data)
            yield from store_steps.record(
                self.key, self.run_id, index, entry, prior, in_transaction=True
            )
            return entry

        result, _ = await self.transactions.transact(fn, write, self.fence())
        return result


class RunStepStores:
    """Makes each run's ``RunSteps`` on first use (``TaskContext.steps_for``)."""

    def __init__(
        self,
        driver: AsyncDriver,
        clock: Clock,
        transactions: Transactions | None,
        watched: Collection[str] = (),
        options_for: store_children.OptionsFor | None = None,
    ) -> None:
        self.driver = driver
        self.clock = clock
        self.transactions = transactions
        self.watched = frozenset(watched)
        """The collections the registry waits on (``Registry.waits_on``)."""
        self.options_for = options_for
        """The declared defaults of a spawned child's name."""
        self._indexed: asyncio.Future[None] | None = None

    async def ensure_indexes(self) -> None:
        """The side collection's indexes, once per worker, before the first spill."""
        if self._indexed is None:
            self._indexed = asyncio.ensure_future(self.driver.run(store_steps.ensure_indexes()))
        try:
            await asyncio.shield(self._indexed)
        except Exception:
            self._indexed = None
            raise

    def steps_for(
        self,
        ctx: TaskContext,
        gate: Gate,
        *,
        doc: Mapping[str, Any],
        transactional: bool,
        fence: Callable[[], RunFence],
        loop: asyncio.AbstractEventLoop,
    ) -> RunSteps:
        concurrency = (doc.get("options") or {}).get("concurrency", 1)
        if concurrency != 1:
            raise StepError(
                f"durable steps need a task of concurrency 1 (this one has {concurrency}): "
                "the steps are the task's, and one run at a time records them"
            )
        if transactional:
            raise StepError(
                "a transactional handler has no steps: its writes commit with its SUCCESS; "
                "use ctx.step(..., transactional=True) in a handler that is not"
            )
        store = TaskSteps(
            self.driver,
            self.clock,
            ctx.key,
            ctx.run_id,
            doc.get("options") or {},
            self.transactions,
            fence,
            self.ensure_indexes,
            self.watched,
            self.options_for,
        )
        return RunSteps(
            store,
            doc.get("steps"),
            run_id=ctx.run_id,
            attempt=ctx.attempt,
            loop=loop,
            release=ctx.release,
            # each step's span, under the run's (None without a tracer provider)
            spans=step_tracer(dict(doc), ctx.name, ctx.key, ctx.attempt, ctx.run_id),
            gate=gate,
        )
