"""Debounce, run by a real worker process: 100 publishes of a key over 3 s
become one run with the last params, started the quiet period after the last publish (both
times the server's); under a steady stream the maximum wait holds (a window runs while the
stream goes on, and no publish is lost); racing publishers open one window; bad input is
refused by Python, the CLI and REST; the task says it is debounced; docs/flow-control.md's update
for a publisher in another language, read from the page, joins a window as a publish does."""

from __future__ import annotations

import datetime as dt
import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from harness import run_cli
from prometheus_client import REGISTRY
from pymongo import MongoClient, ReturnDocument
from test_snooze_worker import flow_worker

from mtask import TaskClient
from mtask.errors import InvalidTask
from mtask.explain.states import State
from mtask.models import Task
from mtask.web import create_app

DOC = Path(__file__).parents[2] / "docs" / "flow-control.md"
DOC_HEADING = "Debounce: one run after a quiet period"
RACES = 5


def foreign_update() -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The filter and pipeline of docs/flow-control.md's mongosh ``findOneAndUpdate`` under
    "## Debounce: one run after a quiet period", read from the page (so it cannot drift): its
    unquoted keys quoted and trailing commas dropped, it is JSON."""
    section = DOC.read_text().split(f"## {DOC_HEADING}\n", 1)[1]
    found = re.search(r"```js mongosh\n(.*?)```", section, re.S)
    assert found, f"no mongosh block under {DOC_HEADING}"
    call = re.search(r"db\.tasks\.findOneAndUpdate\((.*)\);", found[1], re.S)
    assert call, found[1]
    quoted = re.sub(r"([{,]\s*)([A-Za-z_$][\w$]*)\s*:", r'\1"\2":', call[1])
    filter_, pipeline = json.loads(re.sub(r",(\s*[\]}])", r"\1", f"[{quoted}]"))
    return filter_, pipeline


TIMES = {"created_at", "updated_at", "available_at", "next_claim_at"}


def shape(doc: dict[str, Any]) -> dict[str, Any]:
    """A window document without what differs between two windows: its key, params, times."""
    kept = {k: v for k, v in doc.items() if k not in {"_id", "params", *TIMES}}
    return {**kept, "debounce": sorted(doc["debounce"])}


def test_the_documented_foreign_update_joins_a_window_as_a_publish_does(
    mongo_uri: str, db_name: str, client: TaskClient, mongo: MongoClient[dict[str, Any]]
) -> None:
    """docs/flow-control.md, "## Debounce: one run after a quiet period": the mongosh update a
    publisher in another language runs, run as written through pymongo: it joins the window
    mtask opened as a second publish (last params, count, due ``min(now + 5 s, max_at)``), the
    window then has the fields a Python publisher's collapsed window has, and it runs once."""
    filter_, pipeline = foreign_update()
    assert (filter_["name"], filter_["debounce.key"]) == ("reindex", "user-42")
    tasks = mongo[db_name]["tasks"]

    def join() -> dict[str, Any] | None:
        return tasks.find_one_and_update(filter_, pipeline, return_document=ReturnDocument.AFTER)

    assert join() is None  # no open window: the foreign publisher inserts one
    # a window with no maximum: due 5 s after the foreign publish, by the server's clock
    opened = client.publish("reindex", "user-42", {"user": 1}, debounce=3600)
    joined = join()
    assert joined is not None and joined["_id"] == opened.task.key
    window = joined["debounce"]
    assert joined["params"] == {"user": 42} and window["count"] == 2
    assert "max_at" not in window and window["first_at"] < window["last_at"]
    assert joined["updated_at"] == window["last_at"]
    assert joined["available_at"] == window["last_at"] + dt.timedelta(seconds=5)
    assert joined["next_claim_at"] == joined["available_at"]
    # the same two publishes by mtask: the same document but for the key, params and times
    client.publish("reindex", "user-43", {"user": 1}, debounce=3600)
    ours = client.publish("reindex", "user-43", {"user": 42}, debounce=3600)
    python = tasks.find_one({"_id": ours.task.key})
    assert python is not None and shape(joined) == {
        **shape(python),
        "debounce": sorted(python["debounce"]),
    }
    assert {k: python["debounce"][k] for k in ("key", "count")} == {"key": "user-43", "count": 2}
    said = client.explain(Task.from_document(joined))
    assert (said.state, said.why) == (State.SCHEDULED, "debounce")
    assert "2 publishes since" in said.reason
    client.cancel(opened.task.key)
    client.cancel(ours.task.key)

    # with a maximum: due at it, sooner than 5 s; a worker runs the window once, last params
    opened = client.publish("reindex", "user-42", {"user": 1}, debounce=1, debounce_max=1)
    joined = join()
    assert joined is not None and joined["_id"] == opened.task.key
    assert joined["available_at"] == joined["debounce"]["max_at"] == joined["next_claim_at"]
    with flow_worker(mongo_uri, db_name):
        done = client.wait(opened.task.key, timeout=60)
    assert done.status == "succeeded" and done.result == {"user": 42} and done.attempts == 1
    assert done.runs[0].claimed_at >= joined["debounce"]["max_at"]
    assert join() is None  # a window whose run started takes no more publishes
    ran = [d["_id"] for d in tasks.find({"debounce.key": "user-42", "status": "succeeded"})]
    assert ran == [opened.task.key]


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
        # quiet as long as the maximum: the window is due at its maximum however slowly the
        # publishes come (a busy machine); publish until the first window ran and a second one
        # opened behind it
        deadline = time.monotonic() + 90
        while sent % 10 or len(windows(client, mongo, db_name, "stream")) < 2:
            assert time.monotonic() < deadline, "no second window opened"
            client.publish("collect", "stream", {"n": sent}, debounce=1.5, debounce_max=1.5)
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


@pytest.mark.parametrize("key", [f"race{n}" for n in range(RACES)])
def test_racing_publishers_open_one_window(client: TaskClient, key: str) -> None:
    """20 publishers at once, several keys in turn (one race may happen to run its publishes
    one after another: the unique index's mutation must not survive them all)."""
    start = threading.Barrier(20)

    def one(n: int) -> Any:
        start.wait()
        return client.publish("collect", key, {"n": n}, debounce=3600)

    with ThreadPoolExecutor(20) as pool:
        results = list(pool.map(one, range(20)))
    assert sum(r.created for r in results) == 1
    (window,) = {r.task.key for r in results}
    task = client.get(window)
    assert task is not None and task.debounce is not None and task.debounce.count == 20
    said = client.explain(task)
    assert (said.state, said.why) == (State.SCHEDULED, "debounce")
    assert f"unless `{key}` is published again; 20 publishes since" in said.reason


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
