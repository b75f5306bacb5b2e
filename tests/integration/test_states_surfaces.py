"""A task explains itself, against a real worker process: tasks in every derived state
and every blocked reason (``tests/states_scenario.py``), read through the client,
the REST API (``state``, ``why``, ``reason``; ``?state=``; ``/stats?by=state``;
``/limits?use=true``) and the CLI at 80 columns (``get``, ``list --state``, ``limits``); the
limits' blocked counts agree with the tasks' own states."""

from __future__ import annotations

import json
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any, get_args

import pytest
import states_scenario as scenario
from fastapi.testclient import TestClient
from harness import run_cli, worker_process
from pymongo import MongoClient

from mtask import TaskClient
from mtask.explain.states import OPEN_STATES, STATES
from mtask.web import create_app
from mtask.web.schemas import DerivedState

TOKEN = "states-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def states_db(mongo: MongoClient[dict[str, Any]], mongo_uri: str) -> Iterator[str]:
    """One database holding the scenario, its worker running while the module's tests read."""
    name = f"t_states_{uuid.uuid4().hex[:10]}"
    with TaskClient(mongo_uri, database=name) as client:
        scenario.before_worker(client)
        with worker_process(mongo_uri, name, *scenario.WORKER_ARGS):
            scenario.with_worker(client)
            yield name
            scenario.finish(client)
    mongo.drop_database(name)


def cli(*argv: str) -> tuple[int, str, str]:
    return run_cli(*argv, width=80)


def test_the_openapi_spec_names_every_state() -> None:
    assert list(get_args(DerivedState)) == list(STATES)


def test_every_state_and_reason_through_the_client(mongo_uri: str, states_db: str) -> None:
    with TaskClient(mongo_uri, database=states_db) as client:
        for key, (state, why, words) in scenario.EXPECTED.items():
            task = client.get(key)
            assert task is not None, key
            said = client.explain(task)
            assert (said.state.value, said.why) == (state, why), (key, said)
            assert words in said.reason, (key, said.reason)
        acme3 = client.explain(client.get("acme-3"))  # type: ignore[arg-type]
        assert acme3.reason.endswith("; 1 ahead of this one")  # acme-2 is


def test_the_api_says_the_state_filters_by_it_and_counts_it(mongo_uri: str, states_db: str) -> None:
    with TestClient(create_app(mongo_uri, database=states_db, token=TOKEN)) as api:
        task = api.get("/tasks/acme-3", headers=AUTH).json()
        assert (task["state"], task["why"]) == ("blocked", "group")
        assert "`acme-1` holds it" in task["reason"] and "1 ahead of this one" in task["reason"]
        page = api.get("/tasks", params={"limit": 100}, headers=AUTH).json()
        states = {t["key"]: t["state"] for t in page["tasks"]}
        assert {k: states[k] for k in scenario.EXPECTED} == {
            k: v[0] for k, v in scenario.EXPECTED.items()
        }
        for state in STATES:
            found = api.get("/tasks", params={"state": state, "limit": 100}, headers=AUTH)
            assert found.status_code == 200, found.text
            keys = {t["key"] for t in found.json()["tasks"]}
            assert keys == {k for k, v in states.items() if v == state}, state
        refused = api.get("/tasks", params={"state": "stuck"}, headers=AUTH)
        assert refused.status_code == 422 and "state" in refused.text
        both = api.get("/tasks", params={"state": "blocked", "status": "pending"}, headers=AUTH)
        assert both.status_code == 422 and "state" in both.text
        counts = api.get("/stats", params={"by": "state"}, headers=AUTH).json()
        totals: Counter[str] = Counter()
        for row in counts.values():
            totals.update(row)
        want = Counter(v[0] for v in scenario.EXPECTED.values())
        want["running"] += 2  # acme-1 and sc-1 run too
        want["blocked"] += 1  # acme-2, behind acme-1 like acme-3
        assert {s: totals[s] for s in STATES} == {s: want[s] for s in STATES}
        limits = api.get("/limits", params={"use": "true"}, headers=AUTH).json()
        use = {d["_id"]: d["use"] for d in limits}
        assert (use["sleep"]["locks"], use["sleep"]["blocked"]) == (1, 2)
        [acme] = use["sleep"]["groups"]
        assert (acme["group"], acme["head"], acme["holds_lock"], acme["blocked"]) == (
            "acme",
            "acme-1",
            True,
            2,
        )
        assert (use["slow_cleanup"]["in_use"], use["slow_cleanup"]["blocked"]) == (1, 1)


def test_the_limits_blocked_counts_agree_with_the_tasks_states(
    mongo_uri: str, states_db: str
) -> None:
    with TaskClient(mongo_uri, database=states_db) as client:
        for use in client.limit_use():
            page = client.search_state("blocked", name=use.name, limit=100)
            assert use.blocked == len(page.tasks), use.name
            for group in use.groups:
                if group.group is not None:
                    mine = [t for t, _ in page.tasks if t.options.group == group.group]
                    assert group.blocked == len(mine), (use.name, group.group)


def test_the_cli_at_80_columns(mongo_uri: str, states_db: str) -> None:
    common = ("--uri", mongo_uri, "--database", states_db)
    code, out, err = cli("get", "acme-3", *common)
    assert (code, err) == (0, "")
    assert all(len(line) <= 80 for line in out.splitlines()), out
    flat = " ".join(out.split())
    assert "state blocked · group" in flat
    assert "why waiting for group `acme` (sequence): `acme-1` holds it, running" in flat
    assert "1 ahead of this one" in flat and "group acme" in flat

    code, out, _ = cli("get", "fail-1", "--traceback", *common)
    assert code == 0 and "ValueError: this task always fails (in workerapp.py:" in " ".join(
        out.split()
    )
    assert "mtask frames: " in out and "File " in out  # the user's frame, mtask's folded

    code, out, _ = cli("get", "flaky-1", *common)
    flat = " ".join(out.split())
    assert "state succeeded" in flat and "on attempt 2 of 4" in flat
    assert "RuntimeError:" in out and "upstream 503" in out  # its run's error: the last line
    assert "Traceback" not in out
    header = out.split("┏")[0]  # the lines above the tables
    assert "error" not in header and "result" in header  # a succeeded task: no error on top

    code, out, _ = cli("list", "--state", "blocked", *common)
    assert code == 0 and all(len(line) <= 80 for line in out.splitlines()), out
    rows = [line.split()[0] for line in out.splitlines()[1:] if not line.startswith(" ")]
    assert sorted(rows) == ["acme-2", "acme-3", "img-1", "paused-1", "sc-2"]
    assert "no live worker handles `resize_image`" in out and "`echo` is paused" in out

    code, out, _ = cli("list", "--state", "waiting", "--json", *common)
    assert sorted((t["_id"], t["why"]) for t in json.loads(out)) == [
        ("dep-1", "dependencies"),
        ("nap-1", "sleep"),
        ("order-1", "signal"),
    ]

    code, out, _ = cli("limits", *common)
    assert code == 0 and all(len(line) <= 80 for line in out.splitlines()), out
    flat = " ".join(out.split())
    assert "1 lock" in flat and "slots held" not in flat
    assert "acme-1 (running, holds the lock)" in flat
    assert "1 of 1" in flat  # slow_cleanup's one run at once, in use


def test_every_reader_says_the_same_states(mongo_uri: str, states_db: str) -> None:
    """One vocabulary over the scenario that holds every state: ``list``, ``get``, ``flow``
    (each task's node), ``stats`` and ``top`` say the derived states the client explains,
    and ``stats`` counts them as the REST API's ``/stats`` and the ``mtask_open_tasks`` gauge
    do."""
    common = ("--uri", mongo_uri, "--database", states_db)
    with TaskClient(mongo_uri, database=states_db) as client:
        tasks = client.list(limit=1000)
        said = dict(zip([t.key for t in tasks], client.explain_all(tasks), strict=True))
        split = client.state_counts()
    code, out, _ = cli("list", "--json", "--limit", "1000", *common)
    assert code == 0
    assert {t["_id"]: (t["state"], t["why"]) for t in json.loads(out)} == {
        k: (e.state.value, e.why) for k, e in said.items()
    }
    for key in scenario.EXPECTED:
        code, out, _ = cli("get", key, "--json", *common)
        assert json.loads(out)["state"] == said[key].state.value, key
        code, out, _ = cli("flow", key, "--json", *common)
        node = json.loads(out)
        assert (node["state"], node["why"]) == (said[key].state.value, said[key].why), key
    code, out, _ = cli("stats", "--json", *common)
    counted: Counter[str] = Counter()
    for row in json.loads(out).values():
        counted.update(row)
    assert counted == Counter(e.state.value for e in said.values())
    assert {n: dict(r) for n, r in split.counts.items()} == json.loads(out)
    with TestClient(create_app(mongo_uri, database=states_db, token=TOKEN)) as api:
        assert api.get("/stats", headers=AUTH).json() == json.loads(out)  # by state, the default
        metrics = api.get("/metrics", headers=AUTH).text
    gauged: Counter[str] = Counter()
    for line in metrics.splitlines():
        if line.startswith("mtask_open_tasks{"):
            gauged[line.split('state="')[1].split('"')[0]] += int(float(line.rsplit(" ", 1)[1]))
    assert gauged == Counter(e.state.value for e in said.values() if e.state in OPEN_STATES)
    for argv in (("top", "--iterations", "1"), ("stats",)):  # ten states: a name a line at 80
        code, out, _ = cli(*argv, *common)
        assert code == 0 and "pending" not in out and "…" not in out, out
        assert "sleep\n    1 running · 2 blocked · 3 total" in out, out
        assert all(len(line) <= 80 for line in out.splitlines()), out
