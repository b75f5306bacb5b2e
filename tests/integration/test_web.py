"""The REST API of ``mtask serve``: auth, publishing, reading, steering, metrics."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, get_args

import pytest
from fastapi.testclient import TestClient
from harness import T0
from promtool import check_metrics

from mtask import TaskClient
from mtask.clock import FixedClock
from mtask.errors import MtaskError
from mtask.store import Outcome, RunState, claim, finish
from mtask.vocabulary import TaskStatus
from mtask.web import create_app
from mtask.web.api import Status
from mtask.web.auth import check_bind, load_token

TOKEN = "test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def api(mongo_uri: str, db_name: str) -> Iterator[TestClient]:
    with TestClient(create_app(mongo_uri, database=db_name, token=TOKEN)) as http:
        yield http


def test_every_route_but_healthz_needs_the_token(api: TestClient) -> None:
    assert api.get("/healthz").json()["ok"] is True
    for method, path in [
        ("get", "/stats"),
        ("get", "/tasks"),
        ("post", "/tasks"),
        ("get", "/tasks/x"),
        ("get", "/workers"),
        ("get", "/metrics"),
        ("post", "/names/n/pause"),
        ("get", "/schedules"),
        ("post", "/tasks/x:reset"),
        ("get", "/limits"),
    ]:
        response = api.request(method, path)
        assert response.status_code == 401, path
        assert response.headers["www-authenticate"] == "Bearer"
    wrong = api.get("/stats", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401
    assert api.get("/stats", headers=AUTH).status_code == 200
    assert "Authorization" in api.get("/openapi.json").json()["info"]["description"]


def test_publish_is_idempotent_and_bad_input_names_the_field(
    api: TestClient, client: TaskClient
) -> None:
    body = {"name": "resize", "key": "img/1", "params": {"w": 5}, "options": {"priority": 2}}
    first = api.post("/tasks", json=body, headers=AUTH)
    assert first.status_code == 201 and first.json()["created"] is True
    again = api.post("/tasks", json=body, headers=AUTH)
    assert again.status_code == 200 and again.json()["created"] is False
    for bad, field in [
        ({**body, "key": "k2", "options": {"colour": 1}}, "'colour'], 'msg': 'unknown option'"),
        ({**body, "key": ""}, "key: must not be empty"),
        ({**body, "key": "k3", "delay": -1}, "delay"),
        ({**body, "key": "k4", "surprise": 1}, "surprise"),
        ({"name": "n"}, "key"),
        ({**body, "key": "k5", "depends_on": ["k5"]}, "a task cannot depend on itself"),
    ]:
        response = api.post("/tasks", json=bad, headers=AUTH)
        assert response.status_code == 422, bad
        assert field in str(response.json()["detail"]), response.json()
    assert [t.key for t in client.list()] == ["img/1"]  # nothing else was written
    batch = api.post(
        "/tasks:batch",
        json={"tasks": [{"name": "n", "key": f"b{i}"} for i in range(5)]},
        headers=AUTH,
    )
    assert batch.json() == {"created": 5, "given": 5}


def test_read_and_steer(api: TestClient, client: TaskClient) -> None:
    client.publish_many([{"name": "n", "key": f"k{i}"} for i in range(5)])
    page = api.get("/tasks", params={"limit": 2}, headers=AUTH).json()
    assert len(page["tasks"]) == 2 and page["next_after"] == page["tasks"][-1]["key"]
    rest = api.get("/tasks", params={"limit": 10, "after": page["next_after"]}, headers=AUTH).json()
    assert len(rest["tasks"]) == 3 and rest["next_after"] is None
    assert api.get("/tasks", params={"status": "nope"}, headers=AUTH).status_code == 422
    assert api.get("/tasks/k1", headers=AUTH).json()["status"] == "pending"
    assert api.get("/tasks/missing", headers=AUTH).status_code == 404
    assert api.post("/tasks/k1:retry", headers=AUTH).status_code == 409
    assert api.post("/tasks/k1:cancel", headers=AUTH).json()["status"] == "cancelled"
    assert api.post("/tasks/k1:retry", headers=AUTH).json()["status"] == "pending"
    assert api.post("/tasks/missing:cancel", headers=AUTH).status_code == 404
    assert api.get("/stats", params={"by": "status"}, headers=AUTH).json() == {"n": {"pending": 5}}
    by_state = api.get("/stats", headers=AUTH).json()["n"]  # the derived states, as get says
    assert sum(by_state.values()) == 5 and "pending" not in by_state
    assert api.post("/names/n/pause", headers=AUTH).json() == {"name": "n", "paused": True}
    assert api.get("/names", headers=AUTH).json() == {"paused": ["n"]}
    assert api.post("/names/n/resume", headers=AUTH).json()["paused"] is False
    assert api.post("/workers/nobody/stop", headers=AUTH).status_code == 404
    assert api.get("/workers", headers=AUTH).json() == []
    assert api.get("/tasks/k1", params={"view": "flow"}, headers=AUTH).json()["key"] == "k1"


def test_schedules_and_limits(api: TestClient, client: TaskClient) -> None:
    client.add_schedule("beat", "n", every=60)
    assert [s["_id"] for s in api.get("/schedules", headers=AUTH).json()] == ["beat"]
    assert api.post("/schedules/beat/pause", headers=AUTH).json()["paused"] is True
    assert api.post("/schedules/nope/pause", headers=AUTH).status_code == 404
    assert api.delete("/schedules/beat", headers=AUTH).status_code == 204
    assert api.delete("/schedules/beat", headers=AUTH).status_code == 404
    limit = api.put("/limits/n", json={"concurrency": 2}, headers=AUTH).json()
    assert limit["concurrency"] == 2
    assert api.put("/limits/n", json={}, headers=AUTH).status_code == 422
    assert api.delete("/limits/n", headers=AUTH).status_code == 204
    assert api.get("/limits", headers=AUTH).json() == []


def test_metrics(api: TestClient, client: TaskClient) -> None:
    api.post("/tasks", json={"name": "metered", "key": "m1"}, headers=AUTH)
    text = api.get("/metrics", headers=AUTH).text
    assert 'mtask_tasks_published_total{name="metered"}' in text
    assert 'mtask_queue_depth{name="metered",status="pending"} 1.0' in text
    assert "mtask_claim_latency_seconds_bucket" in text
    assert 'mtask_due_tasks{name="metered"} 1.0' in text  # serve exports the cluster gauges
    assert 'mtask_oldest_due_age_seconds{name="metered"}' in text
    check_metrics(text)


def test_failed_tasks_show_their_error(api: TestClient, mongo_uri: str, db_name: str) -> None:
    clock = FixedClock(T0)  # in the future: the TTL monitor (the real clock) never removes it
    with TaskClient(mongo_uri, database=db_name, clock=clock) as tc:
        tc.publish("n", "f")
        [doc] = tc._run(claim(["f"], ["n"], "w", clock.now()))
        outcome = Outcome("f", doc["claim_run_id"], RunState.FAIL, error="boom", permanent=True)
        tc._run(finish(outcome, clock.now()))
    task = api.get("/tasks/f", headers=AUTH).json()
    assert task["status"] == "failed" and task["error"] == "boom"
    assert task["runs"][0]["state"] == "FAIL"


def test_token_configuration(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MTASK_API_TOKEN", raising=False)
    assert load_token(None) is None
    monkeypatch.setenv("MTASK_API_TOKEN", " abc ")
    assert load_token(None) == "abc"
    file = tmp_path / "token"
    file.write_text("from-file\n")
    assert load_token(str(file)) == "from-file"
    with pytest.raises(MtaskError, match="cannot read --token-file"):
        load_token(str(tmp_path / "missing"))
    check_bind("127.0.0.1", None)
    check_bind("::1", None)
    check_bind("0.0.0.0", "abc")
    with pytest.raises(MtaskError, match="refusing to serve on 0.0.0.0 without a token"):
        check_bind("0.0.0.0", None)
    assert set(get_args(Status)) == {s.value for s in TaskStatus}


def test_serve_refuses_a_public_address_without_a_token(mongo_uri: str) -> None:
    env_free = {"PATH": "/usr/bin:/bin", "HOME": "/tmp"}
    result = subprocess.run(
        [sys.executable, "-m", "mtask.cli", "serve", "--uri", mongo_uri, "--host", "0.0.0.0"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env_free,
    )
    assert result.returncode == 2
    assert "refusing to serve on 0.0.0.0 without a token" in result.stderr
    assert "Traceback" not in result.stderr


def test_completion_script(capsys: pytest.CaptureFixture[str]) -> None:
    from mtask.cli import main

    assert main(["completion", "bash"]) == 0
    script: Any = capsys.readouterr().out
    assert "complete" in script and "publish" in script and "schedule" in script


def test_bulk_actions_by_filter(api: TestClient, client: TaskClient) -> None:
    client.publish_many([{"name": "a", "key": f"a{i}"} for i in range(6)])
    client.publish_many([{"name": "b", "key": f"b{i}"} for i in range(3)])

    def bulk(action: str, **body: Any) -> dict[str, Any]:
        response = api.post(f"/tasks:{action}", json=body, headers=AUTH)
        assert response.status_code == 200, response.text
        result: dict[str, Any] = response.json()
        return result

    assert bulk("cancel", name="a", dry_run=True) == {
        "action": "cancel",
        "dry_run": True,
        "matched": 6,
        "changed": 0,
        "truncated": False,
    }
    assert client.stats() == {"a": {"pending": 6}, "b": {"pending": 3}}
    assert bulk("cancel", name="a", keys=["a0", "a1", "a2", "b0"])["changed"] == 3
    assert bulk("retry", name="a", status=["cancelled"], keys=["a0"])["changed"] == 1
    # purge never touches an open task, even when asked for pending ones
    assert bulk("purge", status=["pending", "cancelled"], dry_run=True)["matched"] == 2
    assert bulk("purge", status=["pending", "cancelled"])["changed"] == 2
    assert client.get("a1") is None and client.get("a0") is not None
    assert client.stats() == {"a": {"pending": 4}, "b": {"pending": 3}}
    assert bulk("purge")["matched"] == 0
    assert bulk("cancel", older_than=3600)["matched"] == 0  # all changed just now
    assert bulk("cancel")["changed"] == 7
    assert bulk("retry", name="b")["changed"] == 3
    for bad in [{"status": ["nope"]}, {"older_than": -1}, {"surprise": 1}]:
        assert api.post("/tasks:retry", json=bad, headers=AUTH).status_code == 422


def test_search_and_the_typed_spec(api: TestClient, client: TaskClient) -> None:
    client.publish_many([{"name": "img", "key": f"img/{i}"} for i in range(3)])
    client.publish("doc", "doc/1")
    page = api.get("/tasks", params={"prefix": "img/"}, headers=AUTH).json()
    assert sorted(t["key"] for t in page["tasks"]) == ["img/0", "img/1", "img/2"]
    assert [t["key"] for t in api.get("/tasks?name=doc", headers=AUTH).json()["tasks"]] == ["doc/1"]
    spec = api.get("/openapi.json").json()
    schemas = spec["components"]["schemas"]
    assert {"TaskView", "TaskOptions", "Run", "WorkerView", "LimitView", "ScheduleView"} <= set(
        schemas
    )
    assert spec["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"
    get_task = spec["paths"]["/tasks/{key}"]["get"]["responses"]["200"]
    assert "TaskView" in str(get_task) and "FlowNode" in str(get_task)
    assert "TaskOptions" in str(schemas["NewTaskBody"]["properties"]["options"])
    docs = api.get("/docs").text
    assert "cdn" not in docs.lower() and "/docs/assets/swagger-ui-bundle.js" in docs
    assert api.get("/docs/assets/swagger-ui-bundle.js").status_code == 200
    assert api.get("/redoc").status_code == 200


def test_a_nul_in_a_search_is_a_clear_4xx(api: TestClient) -> None:
    for query in ("prefix=a%00b", "q=Value%00Error"):
        reply = api.get(f"/tasks?{query}", headers=AUTH)
        assert 400 <= reply.status_code < 500, (query, reply.status_code, reply.text)
        assert "NUL" in reply.text


def test_text_bson_cannot_hold_is_a_422_naming_the_field(
    api: TestClient, client: TaskClient
) -> None:
    """A lone surrogate (valid JSON: "\\ud800") in a key, name or key list, or a run_at out of
    range in UTC: 422 naming the field, nothing written (not a 500 from the encoder)."""
    headers = {**AUTH, "content-type": "application/json"}
    good = [{"name": "n", "key": f"h{i}"} for i in range(1000)]
    for path, body, where in [
        ("/tasks", {"name": "n", "key": "\ud800"}, "'body', 'key'"),
        ("/tasks", {"name": "\ud800", "key": "k"}, "'body', 'name'"),
        ("/tasks", {"name": "n", "key": "k", "depends_on": ["\ud800"]}, "'depends_on', 0"),
        ("/tasks", {"name": "n", "key": "k", "params": {"\ud800": 1}}, "'body', 'params'"),
        (
            "/tasks",
            {"name": "n", "key": "k", "options": {"run_at": "0001-01-01T00:00:00+14:00"}},
            "'run_at'",
        ),
        ("/tasks:batch", {"tasks": [*good, {"name": "n", "key": "\ud800"}]}, "1000, 'key'"),
        ("/tasks:retry", {"keys": ["\ud800"]}, "'keys', 0"),
        ("/tasks:cancel", {"name": "\ud800"}, "'body', 'name'"),
        ("/tasks:purge", {"keys": ["\ud800"]}, "'keys', 0"),
        ("/tasks/k:signal", {"name": "\ud800"}, "'body', 'name'"),
    ]:
        response = api.post(path, content=json.dumps(body).encode(), headers=headers)
        assert response.status_code == 422, (path, response.text)
        assert where in str(response.json()["detail"]), response.text
    assert client.collection.count_documents({}) == 0
