"""The review's order-200, with a real worker process: a signal sent without a payload
is recorded by the wait as ``null``, the handler fails on it and every retry would replay it;
the CLI warns of the missing payload, says the next signal goes to no wait there is, and ``mtask
step reset`` (one fenced update) hands it to the wait: the task succeeds with it. Then the
reset's refusals over the API: a running task (409), no such step (422), no such task (404)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from fastapi.testclient import TestClient
from harness import run_cli, worker_process

from mtask import TaskClient
from mtask.web import create_app

TOKEN = "reset-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def cli(*argv: str) -> tuple[int, str, str]:
    return run_cli(*argv, width=200)


def wait_until(check: Callable[[], Any], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_payload_less_signal_is_redone_by_a_step_reset(
    client: TaskClient, mongo_uri: str, db_name: str
) -> None:
    common = ("--uri", mongo_uri, "--database", db_name)
    options = {"retry_delay_ms": 3_600_000, "max_retries": 3}  # its retry waits an hour
    client.publish("await_approval", "order-200", {"order": 200}, options=options)
    with worker_process(mongo_uri, db_name):

        def waiting() -> bool:
            task = client.get("order-200")
            return task is not None and task.waiting is not None

        wait_until(waiting)
        code, out, err = cli("signal", "order-200", "approved", *common)
        assert code == 0 and "it was waiting, it runs again now" in out
        assert "warning: no --payload: the wait returns None to its handler" in err
        wait_until(lambda: (client.get("order-200").failures or 0) == 1)  # type: ignore[union-attr]
        task = client.get("order-200")
        assert task is not None and "TypeError" in (task.error or "")
        assert client.explain(task).state.value == "retrying"

        code, out, _ = cli("signal", "order-200", "approved", "--payload", '{"by": "ann"}', *common)
        assert code == 0, out
        flat = " ".join(out.split())
        assert "kept, but only a further wait_for('approved') would take it" in flat
        assert "wait:approved already took (signal #1)" in flat
        assert "mtask step reset order-200 wait:approved" in flat

        code, out, _ = cli("step", "reset", "order-200", "wait:approved", *common)
        assert code == 0, out
        flat = " ".join(out.split())
        assert "reset: order-200: removed 1 step (wait:approved)" in flat, out
        assert "It runs again now, from wait:approved." in flat, out
        wait_until(lambda: client.get("order-200").status.value == "succeeded")  # type: ignore[union-attr]
    task = client.get("order-200")
    assert task is not None and task.result == {"approved_by": "ann"}
    assert [(s.name, s.payload) for s in task.signals] == [("approved", {"by": "ann"})]
    assert [s.name for s in task.steps] == ["charge", "wait:approved"]
    assert task.steps[0].attempts == 1  # charge was not reset: called once


def test_the_reset_is_refused_while_a_run_is_in_flight_and_says_what_is_wrong(
    client: TaskClient, mongo_uri: str, db_name: str
) -> None:
    now = client.now()
    step = {
        "name": "charge",
        "kind": "call",
        "state": "done",
        "attempts": 1,
        "run_id": "r1",
        "started_at": now,
    }
    run = {"run_id": "r1", "worker_id": "w", "state": "RUNNING", "claimed_at": now}
    client.publish("await_approval", "busy")
    client.collection.update_one(
        {"_id": "busy"},
        {"$set": {"status": "running", "runs": [run], "steps": [step], "attempts": 1}},
    )
    client.publish("await_approval", "idle")
    client.collection.update_one({"_id": "idle"}, {"$set": {"steps": [step]}})
    with TestClient(create_app(mongo_uri, database=db_name, token=TOKEN)) as api:
        busy = api.post("/tasks/busy:reset", json={"step": "charge"}, headers=AUTH)
        assert busy.status_code == 409 and "is running" in busy.text
        missing = api.post("/tasks/idle:reset", json={"step": "ship"}, headers=AUTH)
        assert missing.status_code == 422 and "has no step 'ship'" in missing.text
        assert "its steps: 'charge'" in missing.text
        nobody = api.post("/tasks/nope:reset", json={"step": "charge"}, headers=AUTH)
        assert nobody.status_code == 404
        odd = api.post("/tasks/idle:reset", json={"step": "charge", "x": 1}, headers=AUTH)
        assert odd.status_code == 422 and "x" in odd.text
        done = api.post("/tasks/idle:reset", json={"step": "charge"}, headers=AUTH)
        assert done.status_code == 200, done.text
        assert done.json() == {
            "key": "idle",
            "step": "charge",
            "removed": ["charge"],
            "signals": 0,
            "woke": True,
        }
    busy_doc = client.collection.find_one({"_id": "busy"})
    assert busy_doc is not None and [s["name"] for s in busy_doc["steps"]] == ["charge"]
    idle = client.get("idle")
    assert idle is not None and idle.steps == []
