"""Node.js publishes with the official ``mongodb`` driver, a real ``mtask-worker`` runs what is
valid, Node reads the results back and waits for one through a change stream."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from harness import node, spawn_worker

from mtask import TaskClient

HERE = Path(__file__).parent


def node_or_skip() -> str:
    """``node`` with the driver installed (``npm ci --prefix tests/acceptance/interop``)."""
    return node(HERE)


def spawn(uri: str, db: str) -> subprocess.Popen[str]:
    return spawn_worker(
        uri, db, "--sweep-interval", "0.5", stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip


def run_node(node: str, script: Path, uri: str, db: str, timeout: float = 120) -> str:
    done = subprocess.run(
        [node, str(script)],
        cwd=HERE,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "MONGODB_URI": uri, "MTASK_DATABASE": db},
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def wait_for_worker(
    client: TaskClient, worker: subprocess.Popen[str], timeout: float = 120
) -> None:
    """Until the worker process registered (a loaded machine may take a while to start it)."""
    deadline = time.monotonic() + timeout
    while not client.workers():
        assert worker.poll() is None, worker.communicate()[1]
        assert time.monotonic() < deadline, "the worker did not start"
        time.sleep(0.1)


@pytest.mark.timeout(400)
def test_node_publishes_and_waits(mongo_uri: str, db_name: str, client: TaskClient) -> None:
    node = node_or_skip()
    worker = spawn(mongo_uri, db_name)
    try:
        wait_for_worker(client, worker)
        out = run_node(node, HERE / "interop.mjs", mongo_uri, db_name, timeout=240)
    finally:
        worker.terminate()
        _, err = worker.communicate(timeout=30)
    events = [json.loads(line) for line in out.splitlines()]
    assert events[0] == {"event": "created", "created": [True, False] + [True] * 9}
    assert events[1] == {"event": "waited", "key": "node-min", "status": "succeeded", "result": 3}
    settled = {e["key"]: e for e in events[2:]}
    docs: dict[str, dict[str, Any]] = {d["_id"]: d for d in client.collection.find()}
    # what Node saw is what the documents hold
    for key, event in settled.items():
        assert event["status"] == docs[key]["status"], key
    expected_results = {
        "node-min": 3,
        "node-full": 42,
        "node-delayed": 4,
        "node-prio": 6,
        "node-retry": "ok",
    }
    for key, result in expected_results.items():
        assert docs[key]["status"] == "succeeded" and docs[key]["result"] == result, docs[key]
    assert docs["node-delayed"]["runs"][0]["claimed_at"] >= docs["node-delayed"]["available_at"]
    assert docs["node-delayed"]["options"]["run_at"] == docs["node-delayed"]["available_at"]
    assert docs["node-prio"]["options"]["priority"] == 9
    assert docs["node-retry"]["attempts"] == 2 and docs["node-retry"]["failures"] == 1
    reasons = {
        "node-iso": "'run_at' must be a date, found string",
        "node-full-iso": "'available_at' must be a date, found string",
        "node-typo": "'options.max_retry' is not an option",
        "node-junk": "'name' must be a string, found int",
        "node-no-name": "'name' is missing",
    }
    for key, reason in reasons.items():
        assert docs[key]["status"] == "invalid", docs[key]
        assert reason in docs[key]["invalid_reason"], docs[key]["invalid_reason"]
        assert settled[key]["invalid_reason"] == docs[key]["invalid_reason"]
    # none pending forever: every document is settled
    assert {d["status"] for d in docs.values()} <= {"succeeded", "invalid"}, docs
    assert "Traceback" not in err, err
