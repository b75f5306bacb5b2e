"""What a step's plan yields (a generator, no I/O): ``Io``, a write or read through the run's
``StepStore``; ``Invoke``, the step's function; ``Pause``, a wait in place. A ``Runner``
(``mtask.steps.runner``) does what it asks, on the loop or on a thread, and sends back the
answer (or throws the error in)."""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Coroutine, Generator
from dataclasses import dataclass
from typing import Any, TypeVar

from mtask.steps.rules import Doc

T = TypeVar("T")


@dataclass(frozen=True)
class Io:
    make: Callable[[], Coroutine[Any, Any, Any]]


@dataclass(frozen=True)
class Invoke:
    fn: Callable[[], Any]
    step: str | None = None
    """The step whose function this is (``IN_STEP`` while it runs: nothing nests in it)."""
    timeout: float | None = None
    """Its policy's time limit, in seconds (``StepTimeout`` past it)."""
    said: list[Doc] | None = None
    """Where what it says (``ctx.log``, ``ctx.emit``) is held until its record is written."""


@dataclass(frozen=True)
class Pause:
    """Wait ``seconds`` in place (a step policy's backoff between two tries)."""

    seconds: float


Plan = Generator[Io | Invoke | Pause, Any, T]

IN_STEP: contextvars.ContextVar[str | None] = contextvars.ContextVar("mtask_in_step", default=None)
"""The step whose function runs in this context (a thread, a task of ``ctx.gather``)."""
