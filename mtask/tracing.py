"""OpenTelemetry spans around publish, claim and run, when ``opentelemetry-api`` is installed
(and an SDK configured by the application); without it, ``span`` does nothing."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opentelemetry import trace

_tracer: trace.Tracer | None = None
"""mtask's tracer, made when OpenTelemetry's API is first seen loaded: a proxy until the
application sets a tracer provider; it then delegates to that provider."""


def _api() -> ModuleType | None:
    """OpenTelemetry's trace API once a tracer provider can be set: the application loaded it
    (``set_tracer_provider`` is in it), or ``OTEL_PYTHON_TRACER_PROVIDER`` names a provider (the
    API loads it on first use); else None, and nothing is imported (~5 ms of every
    worker's start-up)."""
    loaded = sys.modules.get("opentelemetry.trace")
    if loaded is not None or "OTEL_PYTHON_TRACER_PROVIDER" not in os.environ:
        return loaded
    try:
        from opentelemetry import trace as api
    except ImportError:  # pragma: no cover - the optional dependency is absent
        return None
    return api


def _configured() -> bool:
    """Whether the application has set a tracer provider. Until then every span would be a
    no-op that still costs ~12 µs (attributes, context attach and detach) per task."""
    global _tracer
    api = _api()
    if api is None:
        return False
    if _tracer is None:
        _tracer = api.get_tracer("mtask")
    return not isinstance(api.get_tracer_provider(), api.ProxyTracerProvider)


@contextlib.contextmanager
def span(span_name: str, /, **attributes: Any) -> Iterator[None]:
    if not _configured() or _tracer is None:
        yield
        return
    clean = {f"mtask.{k}": v for k, v in attributes.items() if v is not None}
    with _tracer.start_as_current_span(span_name, attributes=clean):
        yield


# -- messaging spans and the trace context stored in the task ---------------------

MESSAGING_SYSTEM = "mtask"
"""``messaging.system``: no registered value fits (the broker is MongoDB, but the protocol is
mtask's document contract), so the system names itself, as the conventions allow."""


def _messaging(operation: str, op_name: str, name: str | None, key: str | None) -> dict[str, Any]:
    attributes: dict[str, Any] = {
        "messaging.system": MESSAGING_SYSTEM,
        "messaging.operation.type": operation,
        "messaging.operation.name": op_name,
    }
    if name is not None:
        attributes["messaging.destination.name"] = name
    if key is not None:
        attributes["messaging.message.id"] = key
    return attributes


@contextlib.contextmanager
def publish_span(
    name: str | None, key: str | None, count: int | None = None
) -> Iterator[dict[str, str] | None]:
    """A PRODUCER span around a publish; yields the W3C trace context to store in the task
    (``{"traceparent": …, "tracestate": …}``), or None — and costs nothing — without a
    configured tracer provider."""
    if not _configured() or _tracer is None:
        yield None
        return
    from opentelemetry import propagate, trace

    attributes = _messaging("send", "publish", name, key)
    attributes.update({f"mtask.{k}": v for k, v in (("name", name), ("key", key)) if v})
    if count is not None:
        attributes["messaging.batch.message_count"] = count
    span_name = "mtask.publish" if count is None else "mtask.publish_many"
    with _tracer.start_as_current_span(
        span_name, kind=trace.SpanKind.PRODUCER, attributes=attributes
    ):
        carrier: dict[str, str] = {}
        propagate.inject(carrier)
        context = {k: v for k, v in carrier.items() if k in ("traceparent", "tracestate")}
        yield context or None


_NO_SPAN = contextlib.nullcontext()


def run_span(
    doc: dict[str, Any], name: str, key: str, attempt: int
) -> contextlib.AbstractContextManager[None]:
    """The CONSUMER span of one run: a child of the publisher's span when the task holds its
    trace context (one message, one process: the conventions' parent case). Without a tracer
    provider, a context that does nothing (no generator made for each run)."""
    if not _configured() or _tracer is None:
        return _NO_SPAN
    return _run_span(_tracer, doc, name, key, attempt)


@contextlib.contextmanager
def _run_span(
    tracer: trace.Tracer, doc: dict[str, Any], name: str, key: str, attempt: int
) -> Iterator[None]:
    from opentelemetry import propagate, trace

    stored = doc.get("trace")
    carrier = (
        {k: v for k, v in stored.items() if isinstance(v, str)} if isinstance(stored, dict) else {}
    )
    parent = propagate.extract(carrier) if carrier else None
    attributes = _messaging("process", "run", name, key)
    attributes.update({"mtask.name": name, "mtask.key": key, "mtask.attempt": attempt})
    with tracer.start_as_current_span(
        "mtask.run", context=parent, kind=trace.SpanKind.CONSUMER, attributes=attributes
    ):
        yield
