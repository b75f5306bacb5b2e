"""OpenTelemetry spans around publish, claim and run, when ``opentelemetry-api`` is installed
(and an SDK configured by the application); without it, ``span`` does nothing."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

try:
    from opentelemetry import trace
except ImportError:  # pragma: no cover - the optional dependency is absent
    trace = None  # type: ignore[assignment]


@contextlib.contextmanager
def span(span_name: str, /, **attributes: Any) -> Iterator[None]:
    if trace is None:
        yield
        return
    tracer = trace.get_tracer("mtask")
    clean = {f"mtask.{k}": v for k, v in attributes.items() if v is not None}
    with tracer.start_as_current_span(span_name, attributes=clean):
        yield
