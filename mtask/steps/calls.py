"""The call kind of step (``ctx.step``): a function called once, its result recorded and
given back on replay. A step recorded ``done`` returns its result; one recorded ``failed`` is
called again (its attempts and errors kept), under its own policy (``mtask.steps.tries``); what
its function says is held until its record is written (``mtask.follow.output.holding``). A
transactional step's function and its record commit in one transaction
(``StepStore.transact``)."""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Coroutine
from typing import Any

from mtask.errors import MtaskError
from mtask.steps.journal import Journal
from mtask.steps.plan import Io, Plan
from mtask.steps.policy import NO_POLICY, StepPolicy
from mtask.steps.rules import Doc, StepError, error_text
from mtask.steps.runner import Runner
from mtask.steps.spans import OPEN
from mtask.steps.tries import tries

Gate = Callable[[], Coroutine[Any, Any, None]]
"""Awaited before a step's function is called (not before a replay): the run's budgets'
check and its admission by the windows of tokens it takes (``mtask.usage.charges.RunUsage
.check``), which may stop the step or snooze the run."""


class Calls:
    """A run's call steps, recorded in ``journal``; a transactional one's I/O run by
    ``runner``; ``release`` is where what a step's function said goes once its record is
    written (the run's ``RunOutput.release``; ``None``: it is not held); ``gate`` what each
    step awaits before its function is called (``None``: nothing)."""

    def __init__(
        self,
        journal: Journal,
        runner: Runner,
        release: Callable[[list[Any]], None] | None = None,
        gate: Gate | None = None,
    ) -> None:
        self.journal = journal
        self.runner = runner
        self.release = release
        self.gate = gate

    def step(self, name: str, call: Callable[[], Any], policy: StepPolicy = NO_POLICY) -> Plan[Any]:
        journal = self.journal
        index, prior = journal.begin(name, "call")
        if prior is not None and prior.get("state") == "done":
            value = yield from journal.read(prior)
            return value
        if self.gate is not None:
            yield Io(self.gate)
        entry = journal.entry(name, "call", prior, journal.store.now())
        said: list[Any] | None = [] if self.release is not None else None
        try:
            result = yield from tries(journal, entry, call, policy, said)
        except Exception:
            yield from journal.write(index, entry, prior)
            self._said(said)
            raise
        entry.pop("error", None)
        yield from journal.put_result(entry, result)
        yield from journal.write(index, entry, prior)
        self._said(said)
        return result

    def _said(self, said: list[Any] | None) -> None:
        """What the step's function said, now that its record is written."""
        if said and self.release is not None:
            self.release(said)

    async def transactional(
        self, name: str, fn: Callable[..., Any], args: tuple[Any, ...], kw: dict[str, Any]
    ) -> Any:
        if not inspect.iscoroutinefunction(fn):
            raise StepError(
                "a transactional step's function is an async def taking session=: its writes "
                "use the worker's AsyncClientSession (docs/transactions.md)"
            )
        await self.runner.run_async(self.journal.flush())
        before = OPEN.get() if self.journal.spans is not None else None
        index, prior = self.journal.begin(name, "call")
        error: BaseException | None = None
        try:
            return await self._transact(name, fn, args, kw, index, prior)
        except BaseException as exc:
            error = exc
            raise
        finally:
            self.journal.inside = None
            if self.journal.spans is not None:
                self.journal.span_ended(before, error)

    async def _transact(
        self,
        name: str,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kw: dict[str, Any],
        index: int,
        prior: Doc | None,
    ) -> Any:
        journal = self.journal
        if prior is not None and prior.get("state") == "done":
            return await self.runner.run_async(journal.read(prior))
        if self.gate is not None:
            await self.gate()
        started, now = time.monotonic(), journal.store.now()
        made: list[Doc] = []

        def entry_for(result: Any) -> tuple[Doc, bytes | None]:
            entry = journal.entry(name, "call", prior, now)
            entry["state"] = "done"
            entry["transactional"] = True
            journal.tried(entry, journal.store.now(), round((time.monotonic() - started) * 1000))
            data = journal.store_result(entry, result)
            made.append(entry)
            return entry, data

        try:
            result = await journal.store.transact(
                lambda session: fn(*args, session=session, **kw), entry_for, index, prior
            )
        except Exception as exc:
            failed = journal.entry(name, "call", prior, now)
            failed.update(state="failed", error=error_text(exc), transactional=True)
            ms = round((time.monotonic() - started) * 1000)
            journal.tried(failed, journal.store.now(), ms, error_text(exc))
            if not isinstance(exc, MtaskError) or isinstance(exc, StepError):
                await journal.store.record(index, failed, prior)
            raise
        journal.keep(index, made[-1])
        journal.spilled = journal.spilled or "spill" in made[-1]
        return result
