"""``StepStore``: where a run's steps are written and read. The worker's
(``worker/running/step_stores.py``), a child process's pipe to it
(``worker/running/pool/child_steps.py``), a dry replay's (``mtask.steps.preflight``), or memory
(``MemorySteps``, for ``mtask.testing`` and the unit tier)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, Protocol

from mtask.steps.rules import Doc, StepError


class StepStore(Protocol):
    """Where a run's steps are written and read, fenced by the run
    (``worker/running/step_stores.py``)."""

    def now(self) -> dt.datetime:
        """The server's time, as this process estimates it."""
        ...

    async def record(self, index: int, entry: Doc, prior: Doc | None) -> None:
        """Write ``entry`` at ``index`` (replacing ``prior``, or as a new last entry) if the run
        still owns its task; ``LeaseLost`` if it does not."""
        ...

    async def spill(self, data: bytes) -> Doc:
        """Store a large encoded result aside; returns its reference (``id``, ``chunks``,
        ``bytes``) for the step's entry."""
        ...

    async def load(self, spill: Mapping[str, Any]) -> bytes: ...

    async def signals(self, name: str) -> list[Doc]:
        """The task's signals named ``name``, oldest first (``payload``, ``at``)."""
        ...

    async def holds(self, collection: str, predicate: Doc, waiting: Doc | None) -> Doc | None:
        """The document of ``collection`` that ``predicate`` (a find filter) matches now, or
        ``None``. With ``waiting`` (the wait's ``waiting`` document), the wait is announced
        first, fenced by the run: a change from then on wakes the task even before the run
        ends WAITING (``store.datawaits``)."""
        ...

    async def transact(
        self,
        fn: Callable[[Any], Coroutine[Any, Any, Any]],
        entry_for: Callable[[Any], tuple[Doc, bytes | None]],
        index: int,
        prior: Doc | None,
    ) -> Any:
        """Run ``fn(session)`` and record ``entry_for(its result)`` at ``index`` in one
        transaction; returns the result."""
        ...

    # -- workflows ------------------------------------------------------------------------------

    async def record_named(self, entry: Doc, prior: Doc | None) -> None:
        """Write a parallel step's ``entry`` by its name (``ctx.gather``): a new last entry if
        the journal holds no step of that name (``prior`` ``None``), else in place of
        ``prior`` (still the one the run read). ``LeaseLost`` as ``record``."""
        ...

    async def spawn(self, index: int, entry: Doc, children: list[Doc]) -> None:
        """Record the children's step ``entry`` (new, at ``index``) with the task's counter of
        them, then publish the ``children`` (``mtask.steps.children``'s documents),
        idempotently."""
        ...

    async def publish(self, step: str, children: list[Doc]) -> None:
        """Publish the children of step ``step`` again (those that exist stay as they are)."""
        ...

    async def children(self, step: str) -> list[Doc]:
        """The children spawned by step ``step``, in spawn order: ``index``, ``key``,
        ``name``, ``status``, ``result``, ``error`` (read once, when the task resumes)."""
        ...


class MemorySteps:
    """A ``StepStore`` in memory, for ``mtask.testing`` and the unit tier: records in a list,
    signals given by the test, time from ``clock`` (default: the local clock)."""

    def __init__(
        self,
        recorded: list[Doc] | None = None,
        signals: list[Doc] | None = None,
        clock: Callable[[], dt.datetime] | None = None,
        find: Callable[[str, Doc], Doc | None] | None = None,
    ) -> None:
        self.recorded: list[Doc] = recorded if recorded is not None else []
        self.sent: list[Doc] = signals if signals is not None else []
        self.spilled: dict[str, bytes] = {}
        self.clock = clock or (lambda: dt.datetime.now(dt.UTC))
        self.find = find
        """What ``wait_until`` finds: ``find(collection, predicate)``, the test's answer (a
        document or ``None``); without it a ``wait_until`` is a ``StepError``."""
        self.announced: list[Doc] = []
        """The waits announced (``holds`` with ``waiting``), oldest first."""
        self.tasks: dict[str, Doc] = {}
        """The children spawned, by key: ``finish`` ends one, as its worker would."""

    def now(self) -> dt.datetime:
        return self.clock()

    def signal(self, name: str, payload: Any = None) -> None:
        self.sent.append({"name": name, "payload": payload, "at": self.now()})

    async def record(self, index: int, entry: Doc, prior: Doc | None) -> None:
        if index < len(self.recorded):
            self.recorded[index] = dict(entry)
        elif index == len(self.recorded):
            self.recorded.append(dict(entry))
        else:
            raise StepError(f"step {index} recorded after {len(self.recorded)} steps")

    async def spill(self, data: bytes) -> Doc:
        ref = f"spill-{len(self.spilled) + 1}"
        self.spilled[ref] = data
        return {"id": ref, "chunks": 1, "bytes": len(data)}

    async def load(self, spill: Mapping[str, Any]) -> bytes:
        return self.spilled[str(spill["id"])]

    async def signals(self, name: str) -> list[Doc]:
        return [s for s in self.sent if s.get("name") == name]

    async def holds(self, collection: str, predicate: Doc, waiting: Doc | None) -> Doc | None:
        if self.find is None:
            raise StepError("MemorySteps(find=...) answers wait_until: say what it finds")
        if waiting is not None:
            self.announced.append(dict(waiting))
        return self.find(collection, dict(predicate))

    async def record_named(self, entry: Doc, prior: Doc | None) -> None:
        for i, kept in enumerate(self.recorded):
            if kept.get("name") == entry["name"]:
                if prior is None:
                    raise StepError(f"step {entry['name']!r} was recorded meanwhile")
                self.recorded[i] = dict(entry)
                return
        self.recorded.append(dict(entry))

    async def spawn(self, index: int, entry: Doc, children: list[Doc]) -> None:
        await self.record(index, entry, None)
        await self.publish(str(entry.get("tag") or entry["name"]), children)

    async def publish(self, step: str, children: list[Doc]) -> None:
        for child in children:
            self.tasks.setdefault(
                child["key"], {**child, "step": step, "status": "pending", "result": None}
            )

    async def children(self, step: str) -> list[Doc]:
        found = [dict(c) for c in self.tasks.values() if c.get("step") == step]
        return sorted(found, key=lambda c: int(c["index"]))

    def finish(
        self, key: str, result: Any = None, *, status: str = "succeeded", error: str = ""
    ) -> None:
        """End child ``key`` with ``result`` (or ``status`` ``failed`` and its ``error``)."""
        self.tasks[key].update(status=status, result=result, error=error or None)

    async def transact(
        self,
        fn: Callable[[Any], Coroutine[Any, Any, Any]],
        entry_for: Callable[[Any], tuple[Doc, bytes | None]],
        index: int,
        prior: Doc | None,
    ) -> Any:
        result = await fn(None)
        entry, data = entry_for(result)
        if data is not None:
            entry["spill"] = await self.spill(data)
        await self.record(index, entry, prior)
        return result
