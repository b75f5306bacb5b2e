"""Prometheus metrics of a worker process (``--metrics-port``), and OpenTelemetry spans."""

from __future__ import annotations

import datetime as dt
import time
from pathlib import Path

import httpx2 as httpx
from harness import running_worker, worker_process
from promtool import check_metrics
from workerapp import registry

from mtask import TaskClient
from mtask.driver import SyncDriver
from mtask.embedded import free_port
from mtask.store.holds import hold

TESTS = Path(__file__).parents[1]


def scrape(port: int) -> str | None:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text
    except httpx.HTTPError:
        return None


def test_a_worker_serves_its_metrics(mongo_uri: str, db_name: str, client: TaskClient) -> None:
    port = free_port()
    client.publish("add", "ok", {"a": 1, "b": 2})
    client.publish("always_fails", "bad", options={"max_retries": 0})
    client.publish("nobody_runs_this", "due-1")  # a name this worker does not handle: stays due
    client.set_limit(resource="crm", concurrency=3)  # the limits' gauges
    client.set_limit("add", concurrency=2)
    now = client.now()
    SyncDriver(client.db).run(hold("slow", None, now + dt.timedelta(hours=1), now))
    with worker_process(
        mongo_uri, db_name, "--metrics-port", str(port), "--cluster-metrics"
    ) as proc:
        deadline = time.monotonic() + 60
        text = ""
        # the cluster gauges are cached for a few seconds: wait for the counts after both runs
        while not (
            'mtask_runs_failed_total{name="always_fails"} 1.0' in text
            and 'mtask_runs_succeeded_total{name="add"} 1.0' in text
            and 'mtask_queue_depth{name="add"' not in text  # the queue depth has none left
        ):
            assert time.monotonic() < deadline, text[-2000:]
            assert proc.poll() is None
            time.sleep(0.2)
            text = scrape(port) or ""
        health = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2)
        ready = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2)
    assert health.status_code == 200 and health.json() == {"state": "running"}
    assert ready.status_code == 200
    assert 'mtask_runs_claimed_total{name="add"} 1.0' in text
    assert 'mtask_runs_succeeded_total{name="add"} 1.0' in text
    assert 'mtask_run_duration_seconds_count{name="add"} 1.0' in text
    assert "mtask_claim_latency_seconds_count" in text
    assert "mtask_runs_in_flight 0.0" in text
    assert 'mtask_due_tasks{name="nobody_runs_this"} 1.0' in text
    # the queue depth is the open tasks (finished work is the runs' counters above)
    assert 'mtask_queue_depth{name="nobody_runs_this",status="pending"} 1.0' in text
    # the same task by derived state, as mtask stats says it: no live worker handles its name
    assert 'mtask_open_tasks{name="nobody_runs_this",state="blocked"} 1.0' in text
    assert 'status="succeeded"' not in text and 'status="failed"' not in text
    assert 'mtask_oldest_due_age_seconds{name="nobody_runs_this"}' in text
    assert 'mtask_due_tasks{name="add"}' not in text  # nothing of it is due any more
    assert "mtask_tasks_claimed" not in text and "None" not in text  # runs are not tasks
    assert 'mtask_limit_concurrency{limit="resource:crm"} 3.0' in text
    assert 'mtask_limit_runs_in_use{limit="add"} 0.0' in text  # its run ended
    assert 'mtask_limit_concurrency{limit="add"} 2.0' in text
    assert 'mtask_limit_backing_off{limit="slow"} 1.0' in text
    assert 'mtask_limit_backing_off{limit="add"} 0.0' in text
    assert 'mtask_limit_concurrency{limit="slow"}' not in text  # a hold alone sets none
    check_metrics(text)


def test_only_a_worker_asked_to_exports_the_cluster_gauges(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    port = free_port()
    client.publish("add", "ok", {"a": 1, "b": 2})
    with worker_process(mongo_uri, db_name, "--metrics-port", str(port)) as proc:
        text = ""
        deadline = time.monotonic() + 60
        while 'mtask_runs_succeeded_total{name="add"} 1.0' not in text:
            assert time.monotonic() < deadline and proc.poll() is None, text[-2000:]
            time.sleep(0.2)
            text = scrape(port) or ""
    assert "mtask_queue_depth" not in text and "mtask_due_tasks" not in text
    assert "mtask_open_tasks" not in text
    assert "mtask_limit_runs_in_use" not in text
    check_metrics(text)


def test_due_tasks_on_the_server_clock(client: TaskClient) -> None:
    client.publish("due_a", "a1")
    client.publish("due_a", "a2")
    client.publish("due_a", "a-later", delay=3600)
    client.publish("due_b", "b1")
    # a task is due from its next_claim_at, stamped on the publisher's estimate of the server's
    # clock: it may be a few ms ahead of the server's $$NOW, which decides
    deadline = time.monotonic() + 10
    due = client.due()
    while sum(n for n, _ in due.values()) < 3:
        assert time.monotonic() < deadline, due
        time.sleep(0.01)
        due = client.due()
    assert {name: n for name, (n, _) in due.items()} == {"due_a": 2, "due_b": 1}
    assert all(age >= 0 for _, age in due.values())


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
    # and be unconfigured again: with a provider set, publish stores a trace context
    from opentelemetry.util._once import Once

    trace._TRACER_PROVIDER = None  # type: ignore[attr-defined]
    trace._TRACER_PROVIDER_SET_ONCE = Once()  # type: ignore[attr-defined]
    assert spans["mtask.publish"].attributes["mtask.key"] == "traced"
    assert spans["mtask.run"].attributes["mtask.name"] == "add"
    assert "mtask.claim" in spans
