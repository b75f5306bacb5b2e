"""Prometheus metrics of a worker process (``--metrics-port``), and OpenTelemetry spans."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx
from harness import running_worker
from workerapp import registry

from mtask import TaskClient
from mtask.embedded import free_port

TESTS = Path(__file__).parent


@contextlib.contextmanager
def worker_process(uri: str, db: str, *extra: str) -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "mtask.runner", "workerapp:registry", "--uri", uri,
         "--database", db, "--log-level", "WARNING", *extra],
        cwd=TESTS,
        env={**os.environ, "PYTHONPATH": str(TESTS)},
    )  # fmt: skip
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def scrape(port: int) -> str | None:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text
    except httpx.HTTPError:
        return None


def test_a_worker_serves_its_metrics(mongo_uri: str, db_name: str, client: TaskClient) -> None:
    port = free_port()
    client.publish("add", "ok", {"a": 1, "b": 2})
    client.publish("always_fails", "bad", options={"max_retries": 0})
    with worker_process(mongo_uri, db_name, "--metrics-port", str(port)):
        deadline = time.monotonic() + 60
        text = ""
        # queue depth is cached for a few seconds: wait for the counts after both runs
        while not (
            'mtask_tasks_failed_total{name="always_fails"} 1.0' in text
            and 'mtask_queue_depth{name="add",status="succeeded"} 1.0' in text
        ):
            assert time.monotonic() < deadline, text[-2000:]
            time.sleep(0.2)
            text = scrape(port) or ""
    assert 'mtask_tasks_claimed_total{name="add"} 1.0' in text
    assert 'mtask_tasks_succeeded_total{name="add"} 1.0' in text
    assert 'mtask_run_duration_seconds_count{name="add"} 1.0' in text
    assert "mtask_claim_latency_seconds_count" in text
    assert "mtask_in_flight 0.0" in text
    assert 'mtask_queue_depth{name="add",status="succeeded"} 1.0' in text


async def test_publish_claim_and_run_make_spans(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)  # once per process: no other test sets one
    assert trace.get_tracer_provider() is provider
    async with running_worker(registry, mongo_uri, db_name) as (_, events):
        client.publish("add", "traced", {"a": 1, "b": 1})
        await events.wait("recorded", key="traced")
    spans = {s.name: s for s in exporter.get_finished_spans()}
    provider.shutdown()  # record nothing more for the rest of the session
    assert spans["mtask.publish"].attributes["mtask.key"] == "traced"
    assert spans["mtask.run"].attributes["mtask.name"] == "add"
    assert "mtask.claim" in spans
