"""What the step engine tells a tracer (``StepSpans``), a collaborator a run's steps are built
with: each step begun (run or replayed), a ``ctx.gather`` and its branches, a step policy's
back-off. ``None`` in its place (no tracer provider): nothing is asked, nothing is made.
The OpenTelemetry form is ``mtask.tracing.StepTracer``; no I/O and no OpenTelemetry here."""

from __future__ import annotations

import contextvars
from typing import Any, Protocol


class OpenSpan(Protocol):
    """A span begun and current until it is closed, in the context that began it."""

    def carrier(self) -> dict[str, str] | None:
        """Its W3C context (``traceparent``, ``tracestate``): a spawned child's link."""
        ...

    def close(self, error: BaseException | None = None) -> None:
        """Ended: ``error`` an ``Exception`` fails it; a ``BaseException`` (the run ends
        waiting, or is cancelled) names how it ended."""
        ...


class StepSpans(Protocol):
    """Begins the spans of one run's steps, each a child of what is current (the run's span,
    a gather's branch)."""

    def step(self, name: str, kind: str, replayed: bool, gather: str | None) -> OpenSpan:
        """Step ``name`` of ``kind`` (``call``, ``sleep``, ``signal``, ``data``,
        ``children``) begun: given back as recorded (``replayed``) or run."""
        ...

    def part(self, what: str, **attributes: Any) -> OpenSpan:
        """A part of a step or of a run: ``gather``, ``branch``, ``backoff``."""
        ...


OPEN: contextvars.ContextVar[OpenSpan | None] = contextvars.ContextVar(
    "mtask_step_span", default=None
)
"""The span of the step whose plan runs in this context (a gather's branch has its own)."""


def carrier() -> dict[str, str] | None:
    """The W3C context of the step running here, if it has a span."""
    opened = OPEN.get()
    return opened.carrier() if opened is not None else None
