"""A scripted driver: runs a store operation against a script instead of MongoDB.

Each ``Step`` names the collection method the operation must call next and what that call
answers (a reply, or an exception to throw into the operation). The driver asserts the calls
come in that order and that the script is used up (``done``), so a unit test states the exact
``Call`` sequence of a path (procrastinate's ``InMemoryConnector`` idea, without reimplementing
MongoDB: what the server decides is still tested against the server, in the other tiers).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from pymongo.errors import PyMongoError

from mtask.driver import Call, Op, storage_error

T = TypeVar("T")


@dataclass
class Step:
    method: str
    reply: Any = None
    raises: BaseException | None = None
    collection: str = "tasks"
    check: Callable[[Call], object] | None = None
    """Called with the call, to assert on its filter or pipeline."""


class ScriptedDriver:
    """Sync driver over a script (``run``); ``AsyncScriptedDriver`` for async callers."""

    def __init__(self, *steps: Step) -> None:
        self.steps = deque(steps)
        self.calls: list[Call] = []
        self.collections: dict[str, Any] = {}

    def expect(self, *steps: Step) -> None:
        self.steps.extend(steps)

    @property
    def done(self) -> bool:
        return not self.steps

    def _answer(self, call: Call) -> Any:
        self.calls.append(call)
        assert self.steps, f"unexpected call {call.method} on {call.collection}: script used up"
        step = self.steps.popleft()
        assert (call.collection, call.method) == (step.collection, step.method), (
            f"expected {step.method} on {step.collection}, got {call.method} on {call.collection}"
        )
        if step.check is not None:
            step.check(call)
        if step.raises is not None:
            raise step.raises
        return step.reply

    def run(self, op: Op[T]) -> T:
        """What ``SyncDriver.run`` does, with the script in place of the collections."""
        try:
            call = next(op)
            while True:
                try:
                    result = self._answer(call)
                except PyMongoError as exc:
                    call = op.throw(exc)
                else:
                    call = op.send(result)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        except PyMongoError as exc:
            raise storage_error(exc) from exc


class AsyncScriptedDriver(ScriptedDriver):
    async def run(self, op: Op[T]) -> T:  # type: ignore[override]
        return ScriptedDriver.run(self, op)
