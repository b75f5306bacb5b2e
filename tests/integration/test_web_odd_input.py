"""``mtask serve`` on input nobody meant to send: a malformed ``Referer``, repeated headers,
``next`` URLs that lead elsewhere, a signal payload Python's JSON parser refuses. Each gets a
clear 4xx (or a problem shown on the page) naming what is wrong; never a 500."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from mtask import TaskClient
from mtask.web import create_app
from mtask.web.dashboard import local_url

TOKEN = "odd-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
FORM = "application/x-www-form-urlencoded"


@pytest.fixture
def api(mongo_uri: str, db_name: str) -> Iterator[TestClient]:
    app = create_app(mongo_uri, database=db_name, token=TOKEN, sample_seconds=3600)
    with TestClient(app, raise_server_exceptions=False) as http:
        yield http


@pytest.fixture
def loopback(mongo_uri: str, db_name: str) -> Iterator[TestClient]:
    """serve without a token (loopback only): every state-changing route is open."""
    app = create_app(mongo_uri, database=db_name, token=None, sample_seconds=3600)
    with TestClient(app, raise_server_exceptions=False) as http:
        yield http


# -- the guard: headers it cannot read are refused -------------------------------------------

BAD_REFERERS = ["http://[::1", "http://x]/", "http://[zz]/"]
"""An unclosed IPv6 bracket, a stray one, a bracketed host that is no address."""


@pytest.mark.parametrize("referer", BAD_REFERERS)
def test_an_unparsable_referer_is_refused_before_authentication(
    api: TestClient, loopback: TestClient, referer: str
) -> None:
    headers = {"Referer": referer, "Content-Type": FORM}
    for http, path in [(api, "/login"), *((loopback, p) for p in ("/login", "/tasks", "/ui/act"))]:
        answer = http.post(path, content=b"token=x", headers=headers)
        assert answer.status_code == 403, (path, answer.status_code, answer.text)
        assert "Referer is not a URL" in answer.json()["detail"]


def test_repeated_headers_the_guard_decides_on_are_refused(
    api: TestClient, client: TaskClient
) -> None:
    """The guard and FastAPI must read one Content-Type: JSON then text/plain made the guard
    skip its depth scan while FastAPI parsed the JSON (a 900-deep signal payload reached
    MongoDB, 503)."""
    client.publish("n", "sig")
    deep = b'{"name": "s", "payload": ' + b"[" * 900 + b"]" * 900 + b"}"
    twice = [("content-type", "application/json"), ("content-type", "text/plain")]
    answer = api.post("/tasks/sig:signal", content=deep, headers=[*AUTH.items(), *twice])
    assert answer.status_code == 400
    assert answer.json()["detail"] == "the content-type header is repeated: send it once"
    shallow = b'{"name": "s", "payload": 1}'
    answer = api.post("/tasks/sig:signal", content=shallow, headers=[*AUTH.items(), *twice])
    assert answer.status_code == 400
    two_tokens = [("authorization", f"Bearer {TOKEN}"), ("authorization", "Bearer other")]
    assert api.get("/stats", headers=two_tokens).status_code == 400
    task = client.get("sig")
    assert task is not None and task.signals == []  # nothing was sent
    once = api.post(
        "/tasks/sig:signal", content=deep, headers={**AUTH, "content-type": "text/plain"}
    )
    assert once.status_code == 422  # one header, the scan and FastAPI agree: not JSON
    other_headers = [*AUTH.items(), ("accept", "text/html"), ("accept", "application/json")]
    assert api.get("/stats", headers=other_headers).status_code == 200  # only those it decides on


# -- where the dashboard's forms send the browser back ----------------------------------------


@pytest.mark.parametrize(
    "next_url",
    ["/\\evil.example", "//evil.example", "/\t/evil.example", "\\\\evil.example", "https://e.x"],
)
def test_next_never_leads_to_another_site(loopback: TestClient, next_url: str) -> None:
    assert local_url(next_url) == "/"
    form = {"action": "cancel", "target": "nope", "next": next_url}
    answer = loopback.post(
        "/ui/act", data=form, headers={"Origin": "http://testserver"}, follow_redirects=False
    )
    assert answer.status_code == 303
    assert answer.headers["location"].startswith("/?problem=")


def test_next_keeps_local_pages(loopback: TestClient) -> None:
    for here in ("/ui/tasks?status=failed", "/ui/tasks/a%5Cb", "/ui/tasks/a\\b"):
        assert local_url(here) == here
    form = {"action": "cancel", "target": "nope", "next": "/ui/tasks?status=failed"}
    answer = loopback.post(
        "/ui/act", data=form, headers={"Origin": "http://testserver"}, follow_redirects=False
    )
    assert answer.headers["location"].startswith("/ui/tasks?status=failed&problem=")


def test_a_signal_payload_with_a_huge_number_names_the_problem(
    loopback: TestClient, client: TaskClient
) -> None:
    client.publish("n", "sig")
    form = {"target": "sig", "name": "s", "payload": "1" * 5000, "next": "/"}
    answer = loopback.post(
        "/ui/signal", data=form, headers={"Origin": "http://testserver"}, follow_redirects=False
    )
    assert answer.status_code == 303
    problem = answer.headers["location"]
    assert "4300+digits" in problem and "nested" not in problem
