"""The step engine's spans (``mtask.steps.spans``, told to ``mtask.tracing.StepTracer``) on
``MemorySteps``, with an SDK of the test's own: each step a span under what is current, run or
replayed; a step policy's back-off under its step; a gather's branches under the gather and
their steps under them; a sleep that ends the run ends its span waiting, and a later run's
span of it done. Without a tracer (``spans=None``) the engine is told nothing."""

from __future__ import annotations

import asyncio
import datetime as dt
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from mtask.steps import MemorySteps, RunSteps, Suspended
from mtask.steps.parallel import gather
from mtask.steps.policy import StepPolicy
from mtask.tracing import StepTracer

T0 = dt.datetime(2026, 11, 24, 12, 0, tzinfo=dt.UTC)


def _attr(span: ReadableSpan, name: str) -> Any:
    return (span.attributes or {}).get(name)


async def _handler(steps: RunSteps, tried: list[str]) -> None:
    def flaky() -> str:
        tried.append("flaky")
        if tried.count("flaky") == 1:
            raise ValueError("once")
        return "ok"

    await steps.step("a", lambda: 1)
    await steps.step("flaky", flaky, policy=StepPolicy(retries=1, backoff=0))
    await gather(steps, [steps.step("p1", lambda: 1), steps.step("p2", lambda: 2)], None)
    await steps.sleep(60, name="nap")
    await steps.step("c", lambda: 3)


def _run(store: MemorySteps, attempt: int, exporter: InMemorySpanExporter) -> list[ReadableSpan]:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    attributes = {"mtask.key": "k", "mtask.name": "n", "mtask.run_id": f"run-{attempt}"}
    steps = RunSteps(
        store,
        list(store.recorded),
        run_id=f"run-{attempt}",
        attempt=attempt,
        spans=StepTracer(tracer, attributes),
    )

    async def run() -> None:
        with tracer.start_as_current_span("mtask.run"):
            try:
                await _handler(steps, [])
            except Suspended as waits:  # the worker records the wait with the run's outcome
                assert waits.wait.entry is not None and waits.wait.index == len(store.recorded)
                store.recorded.append(waits.wait.entry)

    exporter.clear()
    asyncio.run(run())
    return list(exporter.get_finished_spans())


def test_each_step_is_a_span_run_or_replayed_under_its_run() -> None:
    now = [T0]
    store = MemorySteps(clock=lambda: now[0])
    exporter = InMemorySpanExporter()
    first = _run(store, 1, exporter)
    by_name = {(s.name, _attr(s, "mtask.step")): s for s in first}
    run = by_name["mtask.run", None]
    for step in ("a", "flaky"):
        span = by_name["mtask.step", step]
        assert span.parent is not None and span.parent.span_id == run.context.span_id
        assert _attr(span, "mtask.replayed") is False and _attr(span, "mtask.outcome") == "done"
        assert _attr(span, "mtask.key") == "k" and _attr(span, "mtask.run_id") == "run-1"
    (backoff,) = [s for s in first if s.name == "mtask.backoff"]
    assert backoff.parent is not None
    assert backoff.parent.span_id == by_name["mtask.step", "flaky"].context.span_id
    assert _attr(backoff, "mtask.step") == "flaky" and _attr(backoff, "mtask.tries") == 1
    (group,) = [s for s in first if s.name == "mtask.gather"]
    branches = [s for s in first if s.name == "mtask.branch"]
    assert sorted(_attr(b, "mtask.branch") for b in branches) == [0, 1]
    assert all(b.parent is not None and b.parent.span_id == group.context.span_id for b in branches)
    for step in ("p1", "p2"):
        span = by_name["mtask.step", step]
        assert span.parent is not None
        assert span.parent.span_id in {b.context.span_id for b in branches}
        assert _attr(span, "mtask.gather") == "gather#1"
    nap = by_name["mtask.sleep", "nap"]
    assert _attr(nap, "mtask.outcome") == "waiting" and ("mtask.step", "c") not in by_name

    now[0] = T0 + dt.timedelta(minutes=2)  # the sleep is over: the next run replays the rest
    second = _run(store, 2, exporter)
    again = {(s.name, _attr(s, "mtask.step")): s for s in second}
    for step in ("a", "flaky", "p1", "p2"):
        assert _attr(again["mtask.step", step], "mtask.replayed") is True
    assert not [s for s in second if s.name == "mtask.backoff"]  # a replay calls nothing
    assert _attr(again["mtask.sleep", "nap"], "mtask.outcome") == "done"
    assert _attr(again["mtask.step", "c"], "mtask.replayed") is False


def test_a_failed_step_fails_its_span() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    steps = RunSteps(
        MemorySteps(), None, run_id="r", attempt=1, spans=StepTracer(provider.get_tracer("t"), {})
    )

    def boom() -> None:
        raise RuntimeError("no")

    with pytest.raises(RuntimeError):
        asyncio.run(steps.step("boom", boom))
    (span,) = exporter.get_finished_spans()
    assert _attr(span, "mtask.outcome") == "failed" and span.status.status_code.name == "ERROR"
    assert [e.name for e in span.events] == ["exception"]


def test_a_run_to_be_run_again_marks_its_backoff_or_snooze(monkeypatch: pytest.MonkeyPatch) -> None:
    from mtask import tracing

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("mtask")
    monkeypatch.setattr(tracing, "_tracer", tracer)
    monkeypatch.setattr(tracing, "_configured", lambda: True)
    ends = (
        ("FAIL", None, False),
        ("SNOOZED", 5000, False),
        ("FAIL", None, True),
        ("SUCCESS", None, False),
    )
    for n, (state, delay, permanent) in enumerate(ends):
        with tracer.start_as_current_span("mtask.run", attributes={"mtask.key": f"k{n}"}):
            tracing.run_ended(state, delay, permanent)
    spans = exporter.get_finished_spans()
    runs = [s for s in spans if s.name == "mtask.run"]
    assert [_attr(s, "mtask.outcome") for s in runs] == ["FAIL", "SNOOZED", "FAIL", "SUCCESS"]
    marks = [
        (s.name, _attr(s, "mtask.key"), _attr(s, "mtask.delay_ms"), s.parent and s.parent.span_id)
        for s in spans
        if s.name != "mtask.run"
    ]
    assert marks == [
        ("mtask.backoff", "k0", None, runs[0].context.span_id),
        ("mtask.snooze", "k1", 5000, runs[1].context.span_id),
    ]  # a permanent failure and a success are not run again


def test_without_a_tracer_provider_nothing_is_made(monkeypatch: pytest.MonkeyPatch) -> None:
    from mtask import tracing

    monkeypatch.setattr(tracing, "_configured", lambda: False)
    with tracing.run_span({}, "n", "k", 1, "r") as made:
        assert made is None
    assert tracing.step_tracer({}, "n", "k", 1, "r") is None  # the engine is told nothing


def test_a_wait_for_a_signal_is_a_wait_span_ended_waiting_then_done() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    store = MemorySteps()

    def run(attempt: int) -> None:
        spans = StepTracer(provider.get_tracer("t"), {"mtask.run_id": f"r{attempt}"})
        steps = RunSteps(store, list(store.recorded), run_id=f"r{attempt}", attempt=1, spans=spans)
        try:
            asyncio.run(steps.wait_for("approved"))
        except Suspended as waits:
            assert waits.wait.entry is not None
            store.recorded.append(waits.wait.entry)

    run(1)
    store.sent.append({"name": "approved", "payload": {"by": "ann"}, "at": T0})
    run(2)
    waits = [s for s in exporter.get_finished_spans() if s.name == "mtask.wait"]
    assert [(_attr(s, "mtask.run_id"), _attr(s, "mtask.outcome")) for s in waits] == [
        ("r1", "waiting"),
        ("r2", "done"),
    ]
    assert {_attr(s, "mtask.step_kind") for s in waits} == {"signal"}
    assert {_attr(s, "mtask.step") for s in waits} == {"wait:approved"}
