"""Triggers over HTTP (docs/triggers.md, docs/web.md): the REST routes (the token, 404 for an
unknown trigger, 422 for a bad body, pause, resume, reset with and without a scan, a waited-on
collection by ``wait:NAME``) and the dashboard's page with its forms (CSRF, POST-redirect-GET),
also over follower documents of any shape."""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from pymongo import MongoClient
from test_web_odd_documents import TOKEN, sign_in

from mtask.cli import main
from mtask.driver import SyncDriver, collections
from mtask.store import followers
from mtask.web import create_app

AUTH = {"Authorization": f"Bearer {TOKEN}"}
NOW = dt.datetime(2026, 11, 28, 12, 0, tzinfo=dt.UTC)


@pytest.fixture
def api(mongo_uri: str, db_name: str, mongo: MongoClient[dict[str, Any]]) -> Iterator[TestClient]:
    driver = SyncDriver(collections(mongo[db_name]))
    declared = [
        followers.Declared("trigger", "ship", "orders", {"task": "ship", "match": '{"a": 1}'}),
        followers.Declared("wait", "invoices", "invoices", {"collection": "invoices"}),
    ]
    driver.run(followers.declare("tasks", declared, NOW))
    app = create_app(mongo_uri, database=db_name, token=TOKEN, sample_seconds=3600)
    with TestClient(app, raise_server_exceptions=False) as http:
        yield http


def signed_in(api: TestClient) -> str:
    """Sign in (as the odd documents' tests do); the session's CSRF token."""
    sign_in(api)
    found = re.search(r'name="csrf-token" content="([^"]+)"', api.get("/ui/triggers").text)
    assert found
    return found.group(1)


def test_the_rest_routes_read_and_steer_triggers(api: TestClient) -> None:
    assert api.get("/triggers").status_code == 401
    assert api.post("/triggers/ship:pause").status_code == 401
    listed = api.get("/triggers", headers=AUTH).json()
    assert [(t["kind"], t["name"], t["held"]) for t in listed] == [
        ("trigger", "ship", False),
        ("wait", "invoices", False),
    ]
    assert listed[0]["spec"]["task"] == "ship" and listed[0]["lag_ms"] is None
    assert api.get("/triggers/wait:invoices", headers=AUTH).json()["collection"] == "invoices"
    missing = api.get("/triggers/nope", headers=AUTH)
    assert missing.status_code == 404 and "no trigger 'nope'" in missing.json()["detail"]
    assert api.post("/triggers/nope:pause", headers=AUTH).status_code == 404
    paused = api.post("/triggers/ship:pause", headers=AUTH)
    assert paused.status_code == 200 and paused.json()["paused"] is True
    assert api.post("/triggers/ship:resume", headers=AUTH).json()["paused"] is False
    reset = api.post("/triggers/wait:invoices:reset", json={"scan": True}, headers=AUTH).json()
    assert reset["scan"] == {"epoch": 1, "done": False, "published": 0}
    assert api.post("/triggers/ship:reset", headers=AUTH).json()["scan"] is None
    for bad in ({"scan": "sometimes"}, {"scan": True, "more": 1}):
        refused = api.post("/triggers/ship:reset", json=bad, headers=AUTH)
        assert refused.status_code == 422, refused.text
    spec = api.get("/openapi.json").json()["paths"]
    assert "/triggers" in spec and "/triggers/{name}:reset" in spec


def test_the_dashboard_page_shows_each_trigger_and_its_forms_act(api: TestClient) -> None:
    assert "sign in" in api.get("/ui/triggers").text.lower()
    csrf = signed_in(api)
    page = api.get("/ui/triggers").text
    assert 'data-trigger="ship"' in page and 'data-trigger="wait:invoices"' in page
    assert "not held" in page and 'href="/ui/triggers"' in page
    origin = {"Origin": "http://testserver"}
    form = {"csrf": csrf, "action": "pause", "target": "ship"}
    done = api.post("/ui/triggers", data=form, headers=origin, follow_redirects=False)
    assert done.status_code == 303 and "paused" in done.headers["location"]
    assert ">paused<" in api.get("/ui/triggers").text
    form = {"csrf": csrf, "action": "reset-scan", "target": "wait:invoices"}
    done = api.post("/ui/triggers", data=form, headers=origin, follow_redirects=False)
    assert "after+a+scan" in done.headers["location"]
    for bad in ({"action": "explode", "target": "ship"}, {"action": "pause", "target": "nope"}):
        said = api.post(
            "/ui/triggers", data={"csrf": csrf, **bad}, headers=origin, follow_redirects=False
        )
        assert said.status_code == 303 and "problem=" in said.headers["location"]
    no_csrf = api.post("/ui/triggers", data={"action": "pause", "target": "ship"}, headers=origin)
    assert no_csrf.status_code == 403


def test_a_follower_document_of_any_shape_is_shown(
    api: TestClient, mongo: MongoClient[dict[str, Any]], db_name: str, mongo_uri: str
) -> None:
    mongo[db_name].triggers.insert_many(
        [
            {"_id": "tasks/trigger/odd", "tasks": "tasks", "kind": "trigger", "name": 5},
            {
                "_id": "tasks/trigger/odder",
                "tasks": "tasks",
                "spec": ["x"],
                "lost": "many",
                "scan": "yes",
                "through": "yesterday",
                "at": "noon",
                "lost_at": 5,
            },
        ]
    )
    sign_in(api)
    page = api.get("/ui/triggers")
    assert page.status_code == 200 and 'data-trigger="5"' in page.text
    listed = {t["_id"]: t for t in api.get("/triggers", headers=AUTH).json()}
    odder = listed["tasks/trigger/odder"]
    assert odder["spec"] is None and odder["lost"] is None and odder["scan"] is None
    named = sorted(p.split(":")[0] for p in odder["problems"])
    assert named == ["at", "lost", "lost_at", "scan", "spec", "through"]
    assert listed["tasks/trigger/odd"]["name"] is None and listed["tasks/trigger/odd"]["problems"]
    assert main(["triggers", "--uri", mongo_uri, "--database", db_name]) == 0  # the CLI too


def test_a_tasks_page_says_which_document_it_waits_for(
    api: TestClient, mongo: MongoClient[dict[str, Any]], db_name: str
) -> None:
    until = dt.datetime(2026, 12, 1, tzinfo=dt.UTC)
    step = {
        "name": "until:invoices",
        "kind": "data",
        "state": "waiting",
        "attempts": 0,
        "run_id": "r-1",
        "started_at": NOW,
        "until": until,
        "collection": "invoices",
    }
    waiting = {
        "until": until,
        "index": 0,
        "step": "until:invoices",
        "data": {"collection": "invoices", "ids": ["inv-1"], "filter": {"_id": "inv-1", "x": 1}},
    }
    mongo[db_name].tasks.insert_one(
        {
            "_id": "w1",
            "name": "settle",
            "status": "pending",
            "next_claim_at": until,
            "steps": [step],
            "waiting": waiting,
        }
    )
    sign_in(api)
    page = api.get("/ui/tasks/w1").text
    assert "waiting until <code>invoices</code> holds" in page and "inv-1" in page
    assert "invoices, deadline" not in page  # the deadline is said once, in the reason
    assert "times out at 2026-12-01" in page
