"""The dashboard's forms and their audit, and the rates of failed authentications, against a
real ``mtask serve`` (uvicorn, the real mongod): a viewer is refused every dashboard form,
nothing changes in MongoDB, and each refusal is audited with its true status (not the 303 the
browser gets); an operator's or an admin's same form passes the role gate; the guard's refusals
of a form are audited too; every route has its own action name; wrong bearer tokens, forged or
expired read tokens, bad session cookies and wrong sign-in tokens are limited (429) like other
abuse."""

from __future__ import annotations

import contextlib
import datetime as dt
import re
import socket
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from pymongo import MongoClient
from webserver import serving

from mtask import TaskClient
from mtask.security import read_tokens
from mtask.web import create_app
from mtask.web.access import SAFE
from mtask.web.audit import NOT_ACTIONS, describe, every_route
from mtask.web.auth import Keys, Principal

TOKENS = {
    "view-token": Principal("viewer", "vera"),
    "op-token": Principal("operator", "otto"),
    "admin-token": Principal("admin", "ada"),
}
SECRET = b"a read token secret of some length"

# every dashboard form (mtask/web/templates: macros.html's /ui/act, tasks.html's /ui/bulk,
# task.html's /ui/signal and reset, triggers.html's /ui/triggers), each a viewer must be refused
FORMS: list[tuple[str, str, dict[str, str]]] = [
    ("/ui/act", "cancel", {"action": "cancel", "target": "t1"}),
    ("/ui/act", "retry", {"action": "retry", "target": "t2"}),
    ("/ui/act", "reset", {"action": "reset", "target": "t1", "step": "s"}),
    ("/ui/act", "pause", {"action": "pause", "target": "add"}),
    ("/ui/act", "resume", {"action": "resume", "target": "sub"}),
    ("/ui/act", "stop", {"action": "stop", "target": "w1"}),
    ("/ui/bulk", "cancel", {"action": "cancel", "name": "add", "confirmed": "cancel"}),
    ("/ui/bulk", "retry", {"action": "retry", "name": "add", "confirmed": "retry"}),
    ("/ui/bulk", "purge", {"action": "purge", "name": "add", "confirmed": "purge"}),
    ("/ui/signal", "signal", {"target": "t1", "name": "go", "payload": "{}"}),
    ("/ui/triggers", "trigger", {"action": "pause", "target": "wait:orders"}),
    ("/ui/triggers", "trigger", {"action": "resume", "target": "wait:orders"}),
    ("/ui/triggers", "trigger", {"action": "reset-scan", "target": "wait:orders"}),
]


@pytest.fixture
def url(mongo_uri: str, db_name: str) -> Iterator[str]:
    with serving(mongo_uri, db_name, tokens=TOKENS, read_secret=SECRET) as found:
        yield found


@contextlib.contextmanager
def signed_in(url: str, token: str) -> Iterator[tuple[httpx.Client, str]]:
    """A browser signed in with ``token``, and its session's CSRF token (from the sign-out
    form every page has, so a viewer has one too)."""
    with httpx.Client(base_url=url, timeout=30, follow_redirects=False) as browser:
        page = browser.get("/login")
        csrf = re.search(r'name="csrf" value="([^"]+)"', page.text)
        assert csrf is not None
        answer = browser.post(
            "/login", data={"token": token, "csrf": csrf.group(1)}, headers={"Origin": url}
        )
        assert answer.status_code == 303, answer.text
        page = browser.get("/ui/tasks")
        found = re.search(r'name="csrf" value="([^"]+)"', page.text)
        assert found is not None
        yield browser, found.group(1)


def snapshot(mongo: MongoClient[dict[str, Any]], db_name: str) -> dict[str, list[Any]]:
    """Every document of the database but the audit's (and the charts' samples, written by
    serve's own side task)."""
    db = mongo[db_name]
    return {
        name: sorted((repr(d) for d in db[name].find()), key=str)
        for name in sorted(db.list_collection_names())
        if name not in ("audit", "throughput")
    }


def audit(url: str) -> list[dict[str, Any]]:
    with httpx.Client(base_url=url, timeout=30) as admin:
        got = admin.get(
            "/audit", params={"limit": 200}, headers={"Authorization": "Bearer admin-token"}
        )
    assert got.status_code == 200, got.text
    records: list[dict[str, Any]] = got.json()
    return records[::-1]  # oldest first


def post_forms(browser: httpx.Client, csrf: str, url: str) -> list[httpx.Response]:
    return [
        browser.post(
            path, data={"csrf": csrf, "next": "/ui/tasks", **fields}, headers={"Origin": url}
        )
        for path, _, fields in FORMS
    ]


def test_a_viewer_is_refused_every_dashboard_form_and_each_refusal_is_audited(
    url: str, client: TaskClient, mongo: MongoClient[dict[str, Any]], db_name: str
) -> None:
    client.publish("add", "t1", {"a": 1, "b": 1})
    client.publish("add", "t2", {"a": 1, "b": 1})
    client.cancel("t2")
    client.pause("sub")
    before = snapshot(mongo, db_name)
    with signed_in(url, "view-token") as (browser, csrf):
        answers = post_forms(browser, csrf, url)
    for (path, action, _), answer in zip(FORMS, answers, strict=True):
        assert answer.status_code == 303, (path, action, answer.text)
        said = answer.headers["location"]
        assert "problem=a+viewer+may+not" in said, (path, action, said)
    assert snapshot(mongo, db_name) == before  # nothing changed in MongoDB
    records = [r for r in audit(url) if r["who"] == "vera"]
    seen = [(r["action"], r["path"], r["status"], r["via"]) for r in records]
    assert seen == [(action, path, 403, "dashboard") for path, action, _ in FORMS]
    assert [r["verb"] for r in records if r["path"] == "/ui/triggers"] == [
        "pause",
        "resume",
        "reset-scan",
    ]
    with signed_in(url, "op-token") as (operator, _):
        page = operator.get("/ui/audit").text
    assert 'trigger <span class="muted">reset-scan</span>' in page


def test_an_operators_and_an_admins_same_forms_pass_the_role_gate(
    url: str, client: TaskClient
) -> None:
    client.publish("add", "t1", {"a": 1, "b": 1})
    client.publish("add", "t2", {"a": 1, "b": 1})
    client.cancel("t2")
    client.pause("sub")
    with signed_in(url, "op-token") as (operator, csrf):
        answers = post_forms(operator, csrf, url)
    with signed_in(url, "admin-token") as (admin, csrf):
        admin_answers = post_forms(admin, csrf, url)
    for (path, action, _), answer in zip(FORMS, answers, strict=True):
        refused = "may+not" in answer.headers["location"]
        assert refused == (action in ("stop", "purge")), (path, action, answer.headers)
    for (path, action, _), answer in zip(FORMS, admin_answers, strict=True):
        assert "may+not" not in answer.headers["location"], (path, action, answer.headers)
    # what the operator's forms did, as MongoDB holds it (the forms ran in order)
    t1, t2 = client.get("t1"), client.get("t2")
    assert t1 is not None and t2 is not None
    assert "add" in client.paused() and "sub" not in client.paused()
    records = audit(url)
    by_otto = [(r["action"], r["status"]) for r in records if r["who"] == "otto"]
    by_ada = [(r["action"], r["status"]) for r in records if r["who"] == "ada"]
    # the operator: cancel and retry applied (200), no step "s" to reset (422), pause and
    # resume applied, the admin's stop refused (403), bulk cancel and retry applied, the
    # admin's purge refused, the signal sent (t1 retried by the bulk retry), no trigger
    # wait:orders (404: past the role gate)
    assert by_otto == [
        ("cancel", 200),
        ("retry", 200),
        ("reset", 422),
        ("pause", 200),
        ("resume", 200),
        ("stop", 403),
        ("cancel", 200),
        ("retry", 200),
        ("purge", 403),
        ("signal", 200),
        ("trigger", 404),
        ("trigger", 404),
        ("trigger", 404),
    ], by_otto
    # the admin's stop and purge pass the gate too: no worker w1 (404), the purge applied
    assert ("stop", 404) in by_ada and ("purge", 200) in by_ada


def test_a_refused_dashboard_form_is_audited_with_its_true_status(
    url: str, client: TaskClient
) -> None:
    client.publish("add", "f1", {"a": 1, "b": 1})
    client.cancel("f1")
    with signed_in(url, "op-token") as (operator, csrf):

        def post(path: str, **fields: str) -> str:
            answer = operator.post(
                path, data={"csrf": csrf, "next": "/", **fields}, headers={"Origin": url}
            )
            assert answer.status_code == 303, answer.text
            return answer.headers["location"]

        assert "problem=" in post("/ui/act", action="cancel", target="f1")  # cancelled already
        assert "problem=" in post("/ui/act", action="retry", target="nothing-here")
        assert "problem=" in post("/ui/act", action="frobnicate", target="f1")
        assert "problem=" in post("/ui/signal", target="f1", name="go", payload="{not json")
        assert "problem=" in post("/ui/bulk", action="explode")
        assert "flash=" in post("/ui/act", action="retry", target="f1")
    seen = [(r["action"], r["target"], r["status"]) for r in audit(url)]
    assert seen == [
        ("cancel", "f1", 409),
        ("retry", "nothing-here", 404),
        ("frobnicate", "f1", 422),
        ("signal", "f1", 422),
        ("explode", "", 422),
        ("retry", "f1", 200),
    ]


def test_a_form_the_guard_refuses_is_audited(url: str, client: TaskClient) -> None:
    client.publish("add", "g1", {"a": 1, "b": 1})
    with signed_in(url, "op-token") as (operator, csrf):
        wrong_csrf = operator.post(
            "/ui/act",
            data={"csrf": "0" * 64, "action": "cancel", "target": "g1"},
            headers={"Origin": url},
        )
        elsewhere = operator.post(
            "/ui/triggers",
            data={"csrf": csrf, "action": "pause", "target": "wait:orders"},
            headers={"Origin": "http://evil.example"},
        )
        api = operator.post("/tasks/g1:cancel", headers={"Origin": "http://evil.example"})
    assert wrong_csrf.status_code == elsewhere.status_code == api.status_code == 403
    task = client.get("g1")
    assert task is not None and task.status == "pending"
    seen = [(r["who"], r["action"], r["target"], r["status"], r["via"]) for r in audit(url)]
    assert seen == [
        ("otto", "cancel", "g1", 403, "dashboard"),  # its body read: its action and target
        ("otto", "trigger", "", 403, "dashboard"),  # refused before its body was read
        ("otto", "cancel", "g1", 403, "api"),
    ]


def test_every_route_has_its_own_action_name() -> None:
    app = create_app("mongodb://127.0.0.1:1", tokens=TOKENS)
    named = {}
    for route in every_route(app.routes):
        for method in sorted(getattr(route, "methods", None) or ()):
            path = str(getattr(route, "path", ""))
            if method in SAFE or path in NOT_ACTIONS:
                continue
            concrete = re.sub(r"\{(\w+)(:path)?\}", "x", path)
            scope = {"type": "http", "method": method, "path": concrete, "app": app}
            scope |= {"headers": [], "root_path": "", "query_string": b""}
            named[(method, path)] = describe(scope, b"")["action"]
    assert len(named) >= 25, named
    unnamed = {route for route, action in named.items() if action in ("unknown", "admin-only")}
    assert unnamed == {("POST", "/tasks/{key:path}")}, unnamed  # the unknown task action's 404
    assert named[("POST", "/ui/triggers")] == "trigger"


# -- failed authentications are rate limited -----------------------------------------------------


def expired_read_token() -> str:
    long_ago = dt.datetime.now(dt.UTC) - dt.timedelta(days=1)
    return read_tokens.sign(SECRET, read_tokens.Scope("task", key="r1"), long_ago)


def failing(kind: str, url: str, attempt: int) -> httpx.Response:
    """One failed authentication of ``kind`` (each attempt a different guess)."""
    with httpx.Client(base_url=url, timeout=30, follow_redirects=False) as anyone:
        if kind == "bearer":
            return anyone.get("/tasks/r1", headers={"Authorization": f"Bearer guess-{attempt}"})
        if kind == "forged read token":
            later = dt.datetime.now(dt.UTC) + dt.timedelta(minutes=10)
            good = read_tokens.sign(SECRET, read_tokens.Scope("task", key="r1"), later)
            forged = f"{good.rpartition('.')[0]}.{attempt:043d}"
            return anyone.get("/tasks/r1", headers={"Authorization": f"Bearer {forged}"})
        if kind == "expired read token":
            return anyone.get(f"/tasks/r1?token={expired_read_token()}")
        if kind == "session cookie":
            anyone.cookies.set("mtask_session", f"sid{attempt}.9999999999.admin.YQ.{'0' * 64}")
            return anyone.get("/stats")
        # the sign-in form's CSRF pair, as the login page would give it (its nonce our own)
        anyone.cookies.set("mtask_login", f"nonce{attempt}")
        csrf = Keys.of(None, TOKENS).login_csrf(f"nonce{attempt}")
        return anyone.post(
            "/login", data={"token": f"guess-{attempt}", "csrf": csrf}, headers={"Origin": url}
        )


def raw_status(url: str, request: str, *headers: str) -> int:
    """The status of a request sent as is (its body never sent)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        lines = [f"{request} HTTP/1.1", f"Host: {host}:{port}", *headers, "", ""]
        conn.sendall("\r\n".join(lines).encode())
        return int(conn.makefile("rb").readline().split()[1])


@pytest.mark.parametrize(
    "kind",
    ["bearer", "forged read token", "expired read token", "session cookie", "sign-in token"],
)
def test_failed_authentications_are_rate_limited(
    kind: str, mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    client.publish("add", "r1", {"a": 1, "b": 1})
    burst = 4
    with serving(mongo_uri, db_name, tokens=TOKENS, read_secret=SECRET, rate=(0.01, burst)) as url:
        statuses = [failing(kind, url, attempt).status_code for attempt in range(burst + 2)]
        assert statuses[:burst] == [401] * burst, statuses
        assert statuses[burst:] == [429, 429], statuses
        with httpx.Client(base_url=url, timeout=30) as caller:
            refused = caller.get("/tasks/r1", headers={"Authorization": "Bearer op-token"})
            # a guess cannot be tried from this address, right or wrong
            assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
            # and the guard reads nothing: a body declared past any limit is not even a 413
            assert raw_status(url, "POST /tasks", "Authorization: Bearer op-token",
                              f"Content-Length: {'9' * 12}") == 429  # fmt: skip
            assert caller.get("/healthz").status_code == 200  # never counted
