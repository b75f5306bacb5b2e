"""Roles on the web surface: a viewer is refused every state-changing route of the
OpenAPI document (enumerated, so a new route cannot be forgotten), an operator the admin's;
every action is in the audit (API and dashboard), refused attempts too; read tokens read their
task and nothing else; per-caller rates answer 429 with Retry-After; CORS for read tokens."""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from webserver import serving

from mtask import TaskClient
from mtask.security import read_tokens
from mtask.web.access import ACTION_ROLES, ROUTE_ACTIONS
from mtask.web.auth import Principal

TOKENS = {
    "view-token": Principal("viewer", "vera"),
    "op-token": Principal("operator", "otto"),
    "admin-token": Principal("admin", "ada"),
}
SECRET = b"a read token secret of some length"
ORIGIN = "http://app.example.test"
PARAMS = {
    "key": "k1",
    "name": "add",
    "worker_id": "w1",
    "schedule_id": "s1",
    "group": "g1",
    "resource": "r1",
    "scope": "group",
    "scope_id": "g1",
}


@pytest.fixture
def url(mongo_uri: str, db_name: str) -> Iterator[str]:
    with serving(
        mongo_uri, db_name, tokens=TOKENS, read_secret=SECRET, cors_origins=[ORIGIN]
    ) as found:
        yield found


def http(url: str, token: str | None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.Client(base_url=url, headers=headers, timeout=30)


def unsafe_routes(spec: dict[str, Any]) -> list[tuple[str, str]]:
    found = []
    for path, operations in spec["paths"].items():
        for method in operations:
            if method.upper() not in ("GET", "HEAD", "OPTIONS"):
                found.append((method.upper(), path))
    return found


def concrete(path: str) -> str:
    return re.sub(r"\{(\w+)\}", lambda m: PARAMS[m.group(1)], path)


def test_a_viewer_is_refused_every_state_changing_route(url: str, client: TaskClient) -> None:
    client.publish("add", "k1", {"a": 1, "b": 1})
    with http(url, "view-token") as viewer, http(url, "op-token") as operator:
        spec = viewer.get("/openapi.json").json()
        routes = unsafe_routes(spec)
        assert len(routes) >= 15, routes  # tasks, bulk, names, schedules, limits, workers
        for method, path in routes:
            answer = viewer.request(method, concrete(path), json={})
            assert answer.status_code == 403, (method, path, answer.text)
            assert "viewer may not" in answer.text
            answer = operator.request(method, concrete(path), json={})
            declared = path.replace("{key}", "{key:path}")
            role = ACTION_ROLES.get(ROUTE_ACTIONS.get((method, declared), ""), "admin")
            assert (answer.status_code == 403) == (role == "admin"), (method, path, answer.text)
        assert viewer.get("/tasks/k1").status_code == 200
        assert viewer.get("/audit").status_code == 403


def test_every_action_is_audited_api_and_dashboard(url: str, client: TaskClient) -> None:
    for key in ("a1", "a2"):
        client.publish("add", key, {"a": 1, "b": 1})
    with http(url, "op-token") as operator, http(url, "view-token") as viewer:
        assert operator.post("/tasks/a1:cancel").status_code == 200
        assert viewer.post("/tasks/a2:cancel").status_code == 403
        assert operator.post("/names/add/pause").status_code == 200
        assert operator.post("/tasks:purge", json={"dry_run": True}).status_code == 403
    with httpx.Client(base_url=url, timeout=30, follow_redirects=False) as browser:
        page = browser.get("/login")
        csrf = re.search(r'name="csrf" value="([^"]+)"', page.text)
        assert csrf is not None
        signed = browser.post(
            "/login",
            data={"token": "op-token", "csrf": csrf.group(1)},
            headers={"Origin": url},
        )
        assert signed.status_code == 303
        task_page = browser.get("/ui/tasks/a2")
        assert 'value="cancel"' in task_page.text and "otto (operator)" in task_page.text
        form = re.search(r'name="csrf" value="([^"]+)"', task_page.text)
        assert form is not None
        done = browser.post(
            "/ui/act",
            data={"csrf": form.group(1), "action": "cancel", "target": "a2", "next": "/"},
            headers={"Origin": url},
        )
        assert done.status_code == 303
        audit_page = browser.get("/ui/audit")
        assert audit_page.status_code == 200 and "a2" in audit_page.text
    with http(url, "admin-token") as admin:
        records = admin.get("/audit").json()
    seen = [(r["who"], r["action"], r["target"], r["status"], r["via"]) for r in records]
    assert ("otto", "cancel", "a1", 200, "api") in seen
    assert ("vera", "cancel", "a2", 403, "api") in seen
    assert ("otto", "pause", "add", 200, "api") in seen
    assert ("otto", "purge", "", 403, "api") in seen
    assert ("otto", "cancel", "a2", 200, "dashboard") in seen  # applied (the browser: 303)
    assert all(r["from"] == "127.0.0.1" and r["at"] for r in records)
    newest = dt.datetime.fromisoformat(records[0]["at"])
    assert newest >= dt.datetime.fromisoformat(records[-1]["at"])


def test_a_viewer_sees_no_action_on_the_dashboard(url: str, client: TaskClient) -> None:
    client.publish("add", "v1", {"a": 1, "b": 1})
    with httpx.Client(base_url=url, timeout=30) as browser:
        page = browser.get("/login")
        csrf = re.search(r'name="csrf" value="([^"]+)"', page.text)
        assert csrf is not None
        browser.post(
            "/login", data={"token": "view-token", "csrf": csrf.group(1)}, headers={"Origin": url}
        )
        for path in ("/", "/ui/tasks", "/ui/tasks/v1", "/ui/workers", "/ui/limits"):
            html = browser.get(path).text
            assert "vera (viewer)" in html, path
            assert 'action="/ui/act"' not in html and 'action="/ui/bulk"' not in html, path
            assert 'action="/ui/signal"' not in html and "/ui/audit" not in html, path
        assert browser.get("/ui/audit").status_code == 403


def test_read_tokens_read_their_task_and_nothing_else(url: str, client: TaskClient) -> None:
    client.publish("add", "root", {"a": 1, "b": 1}, options={"group": "acme"})
    client.publish("add", "child", {"a": 1, "b": 1}, depends_on=["root"])
    client.publish("add", "other", {"a": 1, "b": 1}, options={"group": "zeta"})
    one = client.read_token("root", 600, secret=SECRET)
    tree = client.read_token("root", 600, children=True, secret=SECRET)
    group = client.read_token(name="add", group="acme", ttl=600, secret=SECRET)
    with http(url, one) as reader:
        assert reader.get("/tasks/root").json()["key"] == "root"
        assert reader.get("/tasks/root:output").status_code == 200
        assert reader.get("/tasks/other").status_code == 403
        assert reader.get("/tasks/child").status_code == 403
        for path in ("/tasks", "/stats", "/workers", "/audit", "/metrics", "/tasks/root?view=flow"):
            assert reader.get(path).status_code == 403, path
        assert reader.post("/tasks/root:cancel").status_code == 403
        assert "Sign in" in reader.get("/ui/tasks/root").text or reader.get("/").status_code == 401
    with http(url, tree) as reader:
        assert reader.get("/tasks/child").status_code == 200
        assert reader.get("/tasks/other").status_code == 403
    with http(url, group) as reader:
        assert reader.get("/tasks/root").status_code == 200
        assert reader.get("/tasks/other").status_code == 403
        assert reader.get("/tasks/nothing-here").status_code == 403  # no word on other keys
    with http(url, None) as anyone:
        assert anyone.get(f"/tasks/root?token={one}").status_code == 200
        forged = one[:-4] + ("AAAA" if not one.endswith("AAAA") else "BBBB")
        assert anyone.get(f"/tasks/root?token={forged}").status_code == 401
        rotated = client.read_token("root", 600, secret=b"another secret entirely!")
        assert "signature" in anyone.get(f"/tasks/root?token={rotated}").text
    expired = read_tokens.sign(SECRET, read_tokens.Scope("task", key="root"), client.now())
    with http(url, expired) as reader:  # it expired at the server's now: no wait
        refused = reader.get("/tasks/root")
        assert refused.status_code == 401 and "expired" in refused.text


def test_cors_lets_the_named_origin_read_with_a_token(url: str, client: TaskClient) -> None:
    client.publish("add", "c1", {"a": 1, "b": 1})
    token = client.read_token("c1", 600, secret=SECRET)
    with http(url, None) as anyone:
        preflight = anyone.options(
            "/tasks/c1",
            headers={
                "Origin": ORIGIN,
                "Access-Control-Request-Method": "GET",
                "Access-Control-Request-Headers": "authorization",
            },
        )
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == ORIGIN
        got = anyone.get(
            "/tasks/c1", headers={"Origin": ORIGIN, "Authorization": f"Bearer {token}"}
        )
        assert got.status_code == 200 and got.headers["access-control-allow-origin"] == ORIGIN
        elsewhere = anyone.get(
            "/tasks/c1", headers={"Origin": "http://evil.test", "Authorization": f"Bearer {token}"}
        )
        assert "access-control-allow-origin" not in elsewhere.headers


def test_a_caller_past_its_rate_gets_429_with_retry_after(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    client.publish("add", "r1", {"a": 1, "b": 1})
    with (
        serving(mongo_uri, db_name, tokens=TOKENS, rate=(0.01, 2)) as url,
        http(url, "view-token") as viewer,
        http(url, "op-token") as operator,
    ):
        assert [viewer.get("/tasks/r1").status_code for _ in range(2)] == [200, 200]
        refused = viewer.get("/tasks/r1")
        assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
        assert operator.get("/tasks/r1").status_code == 200  # its own bucket
        assert viewer.get("/healthz").status_code == 200  # never counted
