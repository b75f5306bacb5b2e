"""``raise mtask.Snooze(seconds)`` (4b), run by real worker processes: the task runs
again after the snooze on the server's clock, no retry is spent (``max_retries=0`` still
succeeds), the snoozes are counted, and the task says it is snoozed (client, CLI, REST)."""

from __future__ import annotations

import datetime as dt
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import pytest
from fastapi.testclient import TestClient
from harness import run_cli, tree_env

from mtask import RunState, TaskClient
from mtask.explain.states import State
from mtask.testing import worker_argv
from mtask.web import create_app

T = TypeVar("T")
TESTS = Path(__file__).parent.parent


@contextmanager
def flow_worker(uri: str, db: str) -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(
        worker_argv("flowpubapp:registry", uri, db, "--concurrency", "4"),
        cwd=TESTS,
        env=tree_env(),
    )
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def polled(read: Callable[[], T], done: Callable[[T], bool], timeout: float = 30.0) -> T:
    """``read()`` until ``done`` says yes (the worker is another process: no events to await)."""
    deadline = time.monotonic() + timeout
    while True:
        value = read()
        if done(value) or time.monotonic() > deadline:
            return value
        time.sleep(0.05)


@pytest.mark.parametrize("name", ["snoozer", "snoozer_in_child"])
def test_snoozed_runs_spend_no_retry_and_wait_on_the_servers_clock(
    mongo_uri: str, db_name: str, client: TaskClient, name: str
) -> None:
    with flow_worker(mongo_uri, db_name):
        client.publish(name, "s1", {"times": 3, "seconds": 0.3}, options={"max_retries": 0})
        task = client.wait("s1", timeout=60)
    assert task.status == "succeeded" and task.result == 4
    states = [r.state for r in task.runs]
    assert states == [RunState.SNOOZED] * 3 + [RunState.SUCCESS]
    assert (task.failures, task.snoozes, task.attempts) == (0, 3, 4)
    assert all(r.error == "upstream busy for 0.3 s" for r in task.runs[:3])
    for before, after in zip(task.runs, task.runs[1:], strict=False):
        assert before.finished_at is not None
        # both times are the server's: the next claim waited for the snooze
        assert after.claimed_at - before.finished_at >= dt.timedelta(milliseconds=300)


def test_a_snoozed_task_says_so_everywhere(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    with flow_worker(mongo_uri, db_name):
        client.publish("snoozer", "later", {"times": 5, "seconds": 3600})
        client.publish("bad_snooze", "bad", options={"max_retries": 0})
        bad = client.wait("bad", timeout=60)
        task = polled(lambda: client.get("later"), lambda t: t is not None and bool(t.snoozes))
    assert task is not None and task.status == "pending" and task.snoozes == 1
    said = client.explain(task)
    assert (said.state, said.why) == (State.WAITING, "snoozed")
    assert "snoozed until" in said.reason and "upstream busy" in said.reason
    assert "snoozed 1 time" in said.reason
    code, out, _ = run_cli("get", "later", "--uri", mongo_uri, "--database", db_name)
    assert code == 0 and "snoozed" in out and "1 time" in out
    with TestClient(create_app(mongo_uri, database=db_name, token="t")) as http:
        got = http.get("/tasks/later", headers={"Authorization": "Bearer t"}).json()
    assert got["snoozes"] == 1 and got["why"] == "snoozed" and got["state"] == "waiting"
    # a snooze whose delay was changed out of range is the task's failure, not a worker's
    assert bad.status == "failed" and "snooze requested" in (bad.error or "")
