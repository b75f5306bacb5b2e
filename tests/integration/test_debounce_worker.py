"""Debounce (issue 62, 6), run by a real worker process: 100 publishes of a key over 3 s
become one run with the last params, started the quiet period after the last publish (both
times the server's); under a steady stream the maximum wait holds (a window runs while the
stream goes on, and no publish is lost); racing publishers open one window; bad input is
refused by Python, the CLI and REST; the task says it is debounced."""

from __future__ import annotations

import datetime as dt
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from fastapi.testclient import TestClient
from harness import run_cli
from prometheus_client import REGISTRY
from pymongo import MongoClient
from test_snooze_worker import flow_worker

from mtask import TaskClient
from mtask.errors import InvalidTask
from mtask.models import Task
from mtask.states import State
from mtask.web import create_app


def windows(
    client: TaskClient, mongo: MongoClient[dict[str, Any]], db: str, key: str
) -> list[Task]:
    docs = mongo[db]["tasks"].find({"debounce.key": key}).sort("debounce.first_at", 1)
    return [Task.from_document(d) for d in docs]


def test_a_burst_of_publishes_is_one_run_after_the_quiet_period(
    mongo_uri: str, db_name: str, client: TaskClient, mongo: MongoClient[dict[str, Any]]
) -> None:
    def debounced() -> float:
        labels = {"name": "collect"}
        return REGISTRY.get_sample_value("mtask_publishes_debounced_total", labels) or 0.0

    before = debounced()
    with flow_worker(mongo_uri, db_name):
        results = []
        for n in range(100):  # about 3 s of publishes, 30 ms apart
            results.append(client.publish("collect", "burst", {"n": n}, debounce=1.0))
            time.sleep(0.03)
        key = results[0].task.key
        assert results[0].created and not any(r.created for r in results[1:])
        assert debounced() - before == 99  # counted by this publisher's process
        assert {r.task.key for r in results} == {key} and key.startswith("burst~")
        done = client.wait(key, timeout=60)
    (only,) = windows(client, mongo, db_name, "burst")
    assert done.status == "succeeded" and done.result == {"n": 99}  # the last params win
    assert done.attempts == 1 and only.debounce is not None and only.debounce.count == 100
    claimed = done.runs[0].claimed_at
    assert claimed >= only.debounce.last_at + dt.timedelta(seconds=1)  # the server's times


def test_the_maximum_wait_holds_under_a_steady_stream(
    mongo_uri: str, db_name: str, client: TaskClient, mongo: MongoClient[dict[str, Any]]
) -> None:
    sent = 0
    with flow_worker(mongo_uri, db_name):
        deadline = time.monotonic() + 4
        while time.monotonic() < deadline:  # never 1 s of quiet
            client.publish("collect", "stream", {"n": sent}, debounce=1.0, debounce_max=1.5)
            sent += 1
            time.sleep(0.05)
        found = windows(client, mongo, db_name, "stream")
        for task in found:
            client.wait(task.key, timeout=60)
    found = windows(client, mongo, db_name, "stream")
    assert len(found) >= 2
    assert sum(t.debounce.count for t in found if t.debounce) == sent  # no publish lost
    first = client.get(found[0].key)
    assert first is not None and first.debounce is not None and first.debounce.max_at
    ran = first.runs[0].claimed_at
    assert ran >= first.debounce.max_at  # not before it was due
    last = found[-1].debounce
    assert last is not None and ran < last.last_at  # it ran while publishes went on


def test_racing_publishers_open_one_window(client: TaskClient) -> None:
    start = threading.Barrier(20)

    def one(n: int) -> Any:
        start.wait()
        return client.publish("collect", "race", {"n": n}, debounce=3600)

    with ThreadPoolExecutor(20) as pool:
        results = list(pool.map(one, range(20)))
    assert sum(r.created for r in results) == 1
    (key,) = {r.task.key for r in results}
    task = client.get(key)
    assert task is not None and task.debounce is not None and task.debounce.count == 20
    said = client.explain(task)
    assert (said.state, said.why) == (State.SCHEDULED, "debounce")
    assert "unless `race` is published again; 20 publishes since" in said.reason


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"debounce": -1}, "debounce"),
        ({"debounce": "5"}, "debounce"),
        ({"debounce": 5, "debounce_max": 1}, "debounce_max"),
        ({"debounce_max": 5}, "debounce"),
        ({"debounce": 5, "delay": 3}, "debounce"),
        ({"debounce": 5, "supersede": "drop_newer"}, "debounce"),
        ({"debounce": 5, "on_conflict": "reset"}, "debounce"),
    ],
)
def test_bad_input_is_refused(client: TaskClient, kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidTask) as caught:
        client.publish("collect", "bad", **kwargs)
    assert caught.value.field == field


def test_the_cli_and_the_api(mongo_uri: str, db_name: str, client: TaskClient) -> None:
    common = ("--uri", mongo_uri, "--database", db_name)
    code, out, _ = run_cli("publish", "collect", "c", "--debounce", "3600", *common)
    assert code == 0 and "created: c~" in out
    code, out, _ = run_cli("publish", "collect", "c", "--debounce", "3600", *common)
    assert code == 0 and "updated: c~" in out
    code, _, err = run_cli("publish", "collect", "c", "--debounce", "-1", *common)
    assert code == 2 and "debounce" in err
    with TestClient(create_app(mongo_uri, database=db_name, token="t")) as http:
        auth = {"Authorization": "Bearer t"}
        body = {"name": "collect", "key": "c", "debounce": 3600, "params": {"x": 1}}
        again = http.post("/tasks", json=body, headers=auth)
        bad = http.post("/tasks", json={**body, "debounce_max": 1}, headers=auth)
    assert again.status_code == 200 and again.json()["task"]["params"] == {"x": 1}
    assert again.json()["task"]["debounce"]["count"] == 3
    assert 400 <= bad.status_code < 500
    code, out, _ = run_cli("get", again.json()["task"]["key"], *common)
    assert code == 0 and "debounced" in " ".join(out.split())
