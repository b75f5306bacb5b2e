"""OpenTelemetry spans around publish, claim and run, and each run's steps, when
``opentelemetry-api`` is installed (and an SDK configured by the application); without a
tracer provider nothing here is made or computed (docs/events.md, "Traces").

One task, one trace: its runs are children of the trace context stored in the task (``trace``:
the publisher's span, else a ``mtask.task`` span its first run made and stored; a spawned
child's: the spawning step's span, which its runs also link to); each run's steps, gathers,
branches and back-offs are spans under its run span (``StepTracer``, the step engine's
``mtask.steps.spans.StepSpans``)."""

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


_NO_SPAN: contextlib.nullcontext[None] = contextlib.nullcontext()


def task_attributes(
    doc: dict[str, Any], name: str, key: str, attempt: int | None = None, run_id: str | None = None
) -> dict[str, Any]:
    """What a backend filters a task's spans on: ``mtask.key``, ``mtask.name``,
    ``mtask.group`` (if it has one), ``mtask.attempt``, ``mtask.run_id``."""
    attributes: dict[str, Any] = {"mtask.name": name, "mtask.key": key}
    options = doc.get("options")
    group = options.get("group") if isinstance(options, dict) else None
    if isinstance(group, str):
        attributes["mtask.group"] = group
    if attempt is not None:
        attributes["mtask.attempt"] = attempt
    if run_id is not None:
        attributes["mtask.run_id"] = run_id
    return attributes


def run_span(
    doc: dict[str, Any], name: str, key: str, attempt: int, run_id: str | None = None
) -> contextlib.AbstractContextManager[dict[str, str] | None]:
    """The CONSUMER span of one run, a child of the task's stored trace context (one message,
    one process: the conventions' parent case). A task that holds none (its publisher had no
    tracer) gets one: a ``mtask.task`` span made here, whose context the span yields, for the
    worker to store (fenced by the run: ``store.tasks.keep_trace``) so that every later run is
    its child too. Without a tracer provider, a context that does nothing and yields None (no
    generator made for each run)."""
    if not _configured() or _tracer is None:
        return _NO_SPAN
    return _run_span(_tracer, doc, task_attributes(doc, name, key, attempt, run_id))


def _stored(doc: dict[str, Any]) -> dict[str, str]:
    stored = doc.get("trace")
    if not isinstance(stored, dict):
        return {}
    return {k: v for k, v in stored.items() if isinstance(v, str)}


def _carrier(span: trace.Span) -> dict[str, str] | None:
    from opentelemetry import propagate, trace

    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(span))
    return {k: v for k, v in carrier.items() if k in ("traceparent", "tracestate")} or None


@contextlib.contextmanager
def _run_span(
    tracer: trace.Tracer, doc: dict[str, Any], mine: dict[str, Any]
) -> Iterator[dict[str, str] | None]:
    from opentelemetry import context, propagate, trace

    carrier = _stored(doc)
    made = None
    links = []
    if carrier:
        parent = propagate.extract(carrier)
        if isinstance(doc.get("spawn"), dict):  # a child: linked to the step that spawned it
            spawner = trace.get_current_span(parent).get_span_context()
            if spawner.is_valid:
                links.append(trace.Link(spawner, {"mtask.link": "spawned_by"}))
    else:  # the task's trace begins here: every later run is a child of this span too
        root = tracer.start_span(
            "mtask.task", context=context.Context(), attributes={
                k: v for k, v in mine.items() if k not in ("mtask.attempt", "mtask.run_id")
            },
        )  # fmt: skip
        root.end()
        made = _carrier(root)
        parent = trace.set_span_in_context(root)
    attributes = _messaging("process", "run", mine["mtask.name"], mine["mtask.key"])
    attributes.update(mine)
    with tracer.start_as_current_span(
        "mtask.run",
        context=parent,
        kind=trace.SpanKind.CONSUMER,
        attributes=attributes,
        links=links,
    ):
        yield made


def run_ended(state: str, delay_ms: int | None = None, permanent: bool = False) -> None:
    """The current run span's outcome (``mtask.outcome``); a run that ends to be run again
    later marks when it was decided: a ``mtask.backoff`` span (a failure to retry) or a
    ``mtask.snooze`` span (``Snooze``), with ``mtask.delay_ms`` when the run set it (else the
    task's back-off decides it, on the server). Without a tracer provider, nothing."""
    if not _configured() or _tracer is None:
        return
    from opentelemetry import trace

    current = trace.get_current_span()
    if not current.is_recording():
        return
    current.set_attribute("mtask.outcome", state)
    what = {"FAIL": "mtask.backoff", "TIMEOUT": "mtask.backoff", "SNOOZED": "mtask.snooze"}
    if state not in what or permanent:
        return
    attributes = {
        k: v for k, v in getattr(current, "attributes", {}).items() if k.startswith("mtask.")
    }
    attributes.pop("mtask.outcome", None)
    if delay_ms is not None:
        attributes["mtask.delay_ms"] = delay_ms
    _tracer.start_span(what[state], attributes=attributes).end()


def current_context() -> dict[str, str] | None:
    """The W3C context of the current span (a run's, for the child process that runs its
    handler), or None without a tracer provider."""
    if not _configured() or _tracer is None:
        return None
    from opentelemetry import trace

    span = trace.get_current_span()
    return _carrier(span) if span.get_span_context().is_valid else None


def joined(carrier: dict[str, str] | None) -> contextlib.AbstractContextManager[None]:
    """``carrier`` (``current_context``'s, from the worker) current for the block: the spans
    begun in it are its children. Nothing without it or without a tracer provider here."""
    if not carrier or not _configured():
        return _NO_SPAN
    return _joined(carrier)


@contextlib.contextmanager
def _joined(carrier: dict[str, str]) -> Iterator[None]:
    from opentelemetry import context, propagate

    token = context.attach(propagate.extract(carrier))
    try:
        yield
    finally:
        context.detach(token)


# -- the spans of a run's steps ---------------------------------------------------------------

STEP_SPANS = {
    "call": "mtask.step",
    "sleep": "mtask.sleep",
    "signal": "mtask.wait",
    "data": "mtask.wait",
    "children": "mtask.children",
}
"""The span of each kind of step (``mtask.step_kind`` tells a signal wait from a data wait)."""


class _Open:
    """A span made current in the context that began it, until ``close``."""

    __slots__ = ("span", "token")

    def __init__(self, span: trace.Span, token: object) -> None:
        self.span = span
        self.token = token

    def carrier(self) -> dict[str, str] | None:
        return _carrier(self.span)

    def close(self, error: BaseException | None = None) -> None:
        from opentelemetry import context, trace

        context.detach(self.token)  # type: ignore[arg-type]
        if error is None:
            self.span.set_attribute("mtask.outcome", "done")
        elif isinstance(error, Exception):
            self.span.set_attribute("mtask.outcome", "failed")
            self.span.record_exception(error)
            self.span.set_status(trace.Status(trace.StatusCode.ERROR, str(error)[:200]))
        else:  # the run ends waiting there (``Suspended``), or is stopped
            ended = "waiting" if type(error).__name__ == "Suspended" else "stopped"
            self.span.set_attribute("mtask.outcome", ended)
        self.span.end()


class StepTracer:
    """The spans of one run's steps (``mtask.steps.spans.StepSpans``), each carrying the run's
    ``attributes`` (``task_attributes``)."""

    def __init__(self, tracer: trace.Tracer, attributes: dict[str, Any]) -> None:
        self.tracer = tracer
        self.attributes = attributes

    def step(self, name: str, kind: str, replayed: bool, gather: str | None) -> _Open:
        attributes = {
            **self.attributes,
            "mtask.step": name,
            "mtask.step_kind": kind,
            "mtask.replayed": replayed,
        }
        if gather is not None:
            attributes["mtask.gather"] = gather
        return self._open(STEP_SPANS.get(kind, "mtask.step"), attributes)

    def part(self, what: str, **attributes: Any) -> _Open:
        mine = {f"mtask.{k}": v for k, v in attributes.items() if v is not None}
        return self._open(f"mtask.{what}", {**self.attributes, **mine})

    def _open(self, span_name: str, attributes: dict[str, Any]) -> _Open:
        from opentelemetry import context, trace

        span = self.tracer.start_span(span_name, attributes=attributes)
        return _Open(span, context.attach(trace.set_span_in_context(span)))


def step_tracer(
    doc: dict[str, Any], name: str, key: str, attempt: int, run_id: str
) -> StepTracer | None:
    """The spans of a run's steps, or None (nothing asked of the engine) without a tracer
    provider."""
    if not _configured() or _tracer is None:
        return None
    return StepTracer(_tracer, task_attributes(doc, name, key, attempt, run_id))
