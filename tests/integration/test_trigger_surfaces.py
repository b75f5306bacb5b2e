"""Triggers seen and steered from outside (docs/triggers.md): a worker process's metrics and
the cluster gauges (lag, held, paused; promtool-clean), ``mtask triggers`` (list, pause, resume,
reset; bad input exits 2, an unknown trigger 1), and the REST API."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx2 as httpx
import pytest
from harness import wait_for, worker_process
from promtool import check_metrics
from pymongo import MongoClient

from mtask import TaskClient
from mtask.embedded import free_port

TESTS = Path(__file__).parents[1]
Db = MongoClient[dict[str, Any]]


def scrape(port: int) -> str:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text
    except httpx.HTTPError:
        return ""


def cli(mongo_uri: str, db_name: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mtask", *args, "--uri", mongo_uri, "--database", db_name],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.fixture
def worker(mongo_uri: str, db_name: str) -> Any:
    port = free_port()
    with worker_process(
        mongo_uri, db_name, "--metrics-port", str(port), "--cluster-metrics",
        app="triggerapp:registry",
    ) as proc:  # fmt: skip
        yield port, proc


async def test_a_worker_process_exports_its_triggers_metrics_and_the_cluster_lag(
    worker: Any, mongo: Db, db_name: str, client: TaskClient
) -> None:
    port, proc = worker

    def ship_follows() -> bool:  # ship's own stream is open (not only wait:invoices')
        return any(
            v["name"] == "ship" and v["held"] and v.get("through") for v in client.triggers()
        )

    await wait_for(ship_follows, 60)
    mongo[db_name].orders.insert_one({"_id": "o1", "status": "paid", "total": 3})
    try:
        await wait_for(lambda: mongo[db_name].tasks.find_one({"name": "ship"}), 30)
    except TimeoutError:  # what the triggers held then, and whether the worker still ran
        raise AssertionError(("no task from the insert", proc.poll(), client.triggers())) from None

    def scraped() -> str:
        assert proc.poll() is None
        text = scrape(port)
        wanted = (
            'mtask_follower_changes_total{follower="trigger:ship"} 1.0',
            'mtask_trigger_lag_seconds{trigger="ship"}',
            'mtask_trigger_lag_seconds{trigger="wait:invoices"}',
            'mtask_trigger_held{trigger="ship"} 1.0',
            'mtask_trigger_paused{trigger="ship"} 0.0',
            'mtask_trigger_tasks_total{how="created",trigger="ship"} 1.0',
            'mtask_followers_taken_total{follower="trigger:ship"} 1.0',
        )
        return text if all(w in text for w in wanted) else ""

    text = await wait_for(scraped, 60)
    lag = next(
        line
        for line in text.splitlines()
        if line.startswith('mtask_trigger_lag_seconds{trigger="ship"}')
    )
    assert 0 <= float(lag.split()[-1]) < 3600
    check_metrics(text)


async def test_mtask_triggers_lists_pauses_resumes_and_resets(
    worker: Any, mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    await wait_for(lambda: [v for v in client.triggers() if v["held"] and v.get("through")], 60)
    listed = cli(mongo_uri, db_name, "triggers")
    assert listed.returncode == 0, listed.stderr
    assert "ship" in listed.stdout and "wait:invoices" in listed.stdout
    assert "following" in listed.stdout and "orders" in listed.stdout
    as_json = json.loads(cli(mongo_uri, db_name, "triggers", "--json").stdout)
    assert {(d["kind"], d["name"]) for d in as_json} == {("trigger", "ship"), ("wait", "invoices")}
    paused = cli(mongo_uri, db_name, "triggers", "pause", "ship")
    assert paused.returncode == 0 and "paused" in paused.stdout
    await wait_for(
        lambda: not [v for v in client.triggers() if v["name"] == "ship" and v["held"]], 30
    )
    assert "paused" in cli(mongo_uri, db_name, "triggers").stdout
    resumed = cli(mongo_uri, db_name, "triggers", "resume", "ship")
    assert resumed.returncode == 0 and "resumed" in resumed.stdout
    reset = cli(mongo_uri, db_name, "triggers", "reset", "wait:invoices", "--scan")
    assert reset.returncode == 0 and "after a scan" in reset.stdout
    await wait_for(lambda: all(v["held"] for v in client.triggers()), 60)
    unknown = cli(mongo_uri, db_name, "triggers", "pause", "nope")
    assert unknown.returncode == 1 and "no trigger 'nope'" in unknown.stderr
    assert "Traceback" not in unknown.stderr
    for bad in (
        ["triggers", "pause"],
        ["triggers", "list", "x"],
        ["triggers", "pause", "ship", "--scan"],
    ):
        said = cli(mongo_uri, db_name, *bad)
        assert said.returncode == 2 and said.stderr.startswith("mtask: error:"), said.stderr
