"""The process pool as others see it: the worker's heartbeat document carries its children
(pid, busy/idle, runs, RSS) and the pool's counts (recycled, killed, died, time-limit kills);
the dashboard's workers page and ``GET /workers`` show them; the metrics count them."""

from __future__ import annotations

from typing import Any

import poolhandlers
from fastapi.testclient import TestClient
from harness import running_worker, wait_for
from prometheus_client import REGISTRY, generate_latest
from promtool import check_metrics

from mtask import TaskClient
from mtask.web import create_app

TOKEN = "test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
NO_RETRY = {"max_retries": 0}


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def test_the_heartbeat_and_the_dashboard_show_the_children(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    before = {
        "recycled": metric("mtask_pool_children_ended_total", reason="recycled"),
        "killed": metric("mtask_pool_children_ended_total", reason="killed"),
        "limit": metric("mtask_time_limit_kills_total", how="process"),
    }
    async with running_worker(
        poolhandlers.registry, mongo_uri, db_name, concurrency=1, max_tasks_per_child=2
    ) as (worker, events):
        client.publish("sleepy", "slow", options=NO_RETRY)  # hard limit 1 s: its child killed
        await events.wait("recorded", key="slow")
        client.publish("double", "a", {"n": 1})
        client.publish("double", "b", {"n": 2})  # the second run of a child: it is recycled
        await events.wait("recorded", key="a")
        await events.wait("recorded", key="b")
        client.publish("cooperative", "busy")
        await events.wait("claimed", key="busy")
        pool = worker.parts.process_pool
        assert pool is not None
        await wait_for(lambda: pool.state()["busy"] == 1)
        (busy_pid,) = pool.pids

        def beat() -> dict[str, Any] | None:
            (doc,) = client.workers()
            children = (doc.get("pool") or {}).get("children") or []
            shown = [(c["pid"], c["state"]) for c in children]
            return doc if shown == [(busy_pid, "busy")] else None

        doc = await wait_for(beat)
        with TestClient(create_app(mongo_uri, database=db_name, token=TOKEN)) as http:
            page = http.get("/ui/workers", headers=AUTH)
            api = http.get("/workers", headers=AUTH)
        text = generate_latest(REGISTRY).decode()
        client.cancel("busy")
        await events.wait("recorded", key="busy", state="CANCELLED")

    shown = doc["pool"]
    assert {k: shown[k] for k in ("recycled", "killed", "died", "time_limit_kills")} == {
        "recycled": 1,
        "killed": 1,
        "died": 0,
        "time_limit_kills": 1,
    }
    assert shown["started"] == 3 and shown["max_tasks_per_child"] == 2
    (child,) = shown["children"]
    assert child["pid"] == busy_pid and child["tasks"] == 0 and child["busy_since"] is not None
    assert doc["in_flight"] == 1 and doc["waiting"] == 0

    assert page.status_code == 200
    html = page.text
    assert "recycled 1 · killed 1 · died 0 · time-limit kills 1" in html
    assert f'data-pid="{busy_pid}"' in html and f"pid {busy_pid} <b>busy</b>" in html
    assert api.status_code == 200
    (listed,) = api.json()
    assert listed["pool"]["children"][0]["pid"] == busy_pid
    assert listed["pool"]["time_limit_kills"] == 1

    assert metric("mtask_pool_children_ended_total", reason="recycled") == before["recycled"] + 1
    # the time limit's kill, then the cancel's
    assert metric("mtask_pool_children_ended_total", reason="killed") == before["killed"] + 2
    assert metric("mtask_time_limit_kills_total", how="process") == before["limit"] + 1
    assert 'mtask_pool_children{state="busy"} 1.0' in text
    assert 'mtask_pool_children{state="idle"} 0.0' in text
    check_metrics(text)


async def test_a_child_reports_its_memory_after_a_run(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    async with running_worker(poolhandlers.registry, mongo_uri, db_name, concurrency=1) as (
        _,
        events,
    ):
        client.publish("double", "one", {"n": 3})
        await events.wait("recorded", key="one")

        def idle_child() -> dict[str, Any] | None:
            (doc,) = client.workers()
            children = (doc.get("pool") or {}).get("children") or []
            return children[0] if children and children[0]["tasks"] == 1 else None

        child = await wait_for(idle_child)
    assert child["state"] == "idle" and child["busy_since"] is None
    assert child["rss"] > 1024 * 1024  # a Python process: megabytes resident
