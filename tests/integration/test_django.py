"""``mtask.contrib.django`` in a real Django project (tests/djangoproject) on the real replica
set, on both legs: Django 6.1 with django-mongodb-backend 6.1 (Python 3.12: ``.ci/run`` makes
``.venv-django``; ``MTASK_TEST_DJANGO_PYTHON`` names another) and Django 5.2 with the
django-tasks backport and django-mongodb-backend 5.2 (Python 3.11: the dev extra's). The
project runs in its own processes: ``probe.py`` (the test's hands, a JSON line each way) and
``manage.py mtask_worker``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.parse
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from harness import TESTS, stop_process, tree_env
from needs import missing
from pymongo import MongoClient

from mtask.embedded import free_port

pytestmark = pytest.mark.slow
PROJECT = TESTS / "djangoproject"
ROOT = TESTS.parent


def leg_python(leg: str) -> str:
    """The interpreter of a leg, or the test fails under CI / skips, saying what is missing."""
    if leg == "6.1":
        given = os.environ.get("MTASK_TEST_DJANGO_PYTHON") or str(ROOT / ".venv-django/bin/python")
        probe = "import django, django_mongodb_backend as m; assert django.VERSION[:2] == (6, 1)"
        reason = "no Python 3.12 venv with Django 6.1 and django-mongodb-backend 6.1 (.ci/run)"
    else:
        given = os.environ.get("MTASK_TEST_DJANGO52_PYTHON") or sys.executable
        probe = "import django, django_tasks, django_mongodb_backend as m; "
        probe += "assert django.VERSION[:2] == (5, 2)"
        reason = "no Django 5.2, django-tasks and django-mongodb-backend 5.2 (the dev extra)"
    if (
        not Path(given).exists()
        or subprocess.run([given, "-c", probe], capture_output=True).returncode
    ):
        missing(reason)
    return given


class Project:
    """The test project on one leg, on a database of its own."""

    def __init__(self, python: str, uri: str, database: str, tmp: Path) -> None:
        self.python, self.tmp = python, tmp
        self.env = tree_env(PROJECT, MTASK_DJANGO_URI=uri, MTASK_DJANGO_DB=database)
        self.workers: list[subprocess.Popen[Any]] = []
        self.logs: list[Any] = []
        self.server: subprocess.Popen[Any] | None = None
        self.leg = ""
        self.probe = subprocess.Popen(
            [python, "probe.py"], cwd=PROJECT, env=self.env, text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        )  # fmt: skip

    def manage(self, *argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [self.python, "manage.py", *argv], cwd=PROJECT, env=self.env, text=True,
            capture_output=True, timeout=60,
        )  # fmt: skip

    def ask(self, do: str, **given: Any) -> Any:
        assert self.probe.stdin is not None and self.probe.stdout is not None
        self.probe.stdin.write(json.dumps({"do": do, **given}) + "\n")
        self.probe.stdin.flush()
        answer = json.loads(self.probe.stdout.readline())
        assert "error" not in answer, answer["error"]
        assert "timeout" not in answer, answer
        return answer

    def worker(self, *argv: str) -> subprocess.Popen[str]:
        log = (self.tmp / f"worker-{len(self.workers)}.log").open("w")
        self.logs.append(log)
        proc = subprocess.Popen(
            [self.python, "manage.py", "mtask_worker", "--concurrency", "4", *argv],
            cwd=PROJECT, env=self.env, text=True, stdin=subprocess.DEVNULL, stdout=log,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        self.workers.append(proc)
        return proc

    def serve(self, lifespan: str) -> str:
        """The project under uvicorn (djproject/asgi.py: mtask's dashboard at /mtask/), with
        its ASGI lifespan ``on`` or ``off``: its base URL (``up`` waits until it answers)."""
        port = free_port()
        log = (self.tmp / "uvicorn.log").open("w")
        self.logs.append(log)
        self.server = subprocess.Popen(
            [self.python, "-m", "uvicorn", "djproject.asgi:application", "--host", "127.0.0.1",
             "--port", str(port), "--log-level", "warning", "--lifespan", lifespan],
            cwd=PROJECT, env=self.env, stdin=subprocess.DEVNULL, stdout=log,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        self.workers.append(self.server)
        return f"http://127.0.0.1:{port}"

    def up(self, base: str) -> None:
        """The server answers (one that ended fails, with its log)."""
        assert self.server is not None
        while True:
            assert self.server.poll() is None, (self.tmp / "uvicorn.log").read_text()
            try:
                httpx.get(f"{base}/hello/", timeout=5)
                return
            except httpx.TransportError:
                time.sleep(0.05)

    def close(self) -> None:
        for proc in self.workers:
            stop_process(proc)
        stop_process(self.probe)
        for log in self.logs:
            log.close()


@pytest.fixture(params=["6.1", "5.2"])
def project(
    request: pytest.FixtureRequest, mongo_uri: str, mongo: MongoClient[Any], tmp_path: Path
) -> Iterator[Project]:
    python = leg_python(request.param)
    database = f"dj_{uuid.uuid4().hex[:12]}"
    made = Project(python, mongo_uri, database, tmp_path)
    made.leg = request.param
    try:
        migrated = made.manage("migrate", "--noinput")  # makes mtask's indexes too
        assert migrated.returncode == 0, migrated.stderr
        yield made
    finally:
        made.close()
        mongo.drop_database(database)


def release(tmp: Path, name: str) -> str:
    return str(tmp / name)


def test_transactional_enqueue_the_worker_command_and_results(project: Project) -> None:
    ask, tmp = project.ask, project.tmp
    # one atomic() block that raises: neither the order nor the task; one that commits: both
    rolled = ask("atomic", number="A1", fail=True)
    assert rolled == {**rolled, "orders": 0, "task_exists": False, "signalled": 0}
    committed = ask("atomic", number="A2", fail=False)
    assert committed["orders"] == 1 and committed["task_exists"]
    assert committed["signalled_inside"] == 0 and committed["signalled"] == 1  # on commit
    # a queue the backend does not have is refused; one key enqueued twice is one task
    refused = ask("invalid", name="record", using={"queue_name": "nowhere"})
    assert refused["raised"] in ("InvalidTask", "InvalidTaskError")  # Django 6, the backport
    assert "nowhere" in refused["message"]
    first, again = (
        ask("enqueue", name="invoice", args=[17]),
        ask("enqueue", name="invoice", args=[17]),
    )
    assert first["id"] == again["id"] == "invoice-17"
    missing_id = ask("missing", id="no-such-task")
    assert missing_id["raised"] == "TaskResultDoesNotExist"
    # before any worker: READY; tasks of the other queue, with priorities
    gate = ask("enqueue", name="hold", args=[release(tmp, "gate")])
    assert gate["status"] == "READY" and gate["mtask_status"] == "pending" and gate["attempts"] == 0
    emails = {
        label: ask("enqueue", name="record", args=[label], using={"priority": p})["id"]
        for label, p in (("low", -5), ("high", 50), ("middle", 10))
    }
    explode = ask("enqueue", name="explode", args=["widgets"])["id"]
    flaky = ask("enqueue", name="always_flaky")["id"]
    async_id = ask("aenqueue", name="aadd", args=[2, 3])["id"]
    context = ask("enqueue", name="attempt_of", args=["ctx"])["id"]
    later = ask("enqueue", name="aadd", args=[1, 1], using={"run_after_s": 1.0})

    default = project.worker("--queue", "default")
    running = ask("wait", id=gate["id"], status="RUNNING")
    assert running["mtask_status"] == "running" and running["started_at"] is not None
    Path(release(tmp, "gate")).touch()
    done = ask("wait", id=gate["id"], status="SUCCESSFUL")
    assert done["return_value"] == "released" and done["attempts"] == 1
    assert done["finished_at"] >= done["started_at"] >= done["enqueued_at"]

    shipped = ask("wait", id=committed["id"], status="SUCCESSFUL")
    assert shipped["return_value"] == committed["order"]
    assert ask("shipped", order=committed["order"]) == {"shipped": True}
    failed = ask("wait", id=explode, status="FAILED")
    assert [e["class"] for e in failed["errors"]] == ["shop.tasks.OutOfStock"]
    assert "no widgets left" in failed["errors"][0]["traceback"]
    assert failed["error_class_importable"] == "OutOfStock"
    retried = ask("wait", id=flaky, status="FAILED")
    assert retried["attempts"] == 3 and len(retried["worker_ids"]) == 3  # max_retries=2
    assert [e["class"] for e in retried["errors"]] == ["builtins.ValueError"] * 3
    assert ask("wait", id=async_id, status="SUCCESSFUL")["return_value"] == 5
    assert ask("aget", id=async_id)["return_value"] == 5
    told = ask("wait", id=context, status="SUCCESSFUL")["return_value"]
    assert told == {"attempt": 1, "label": "ctx", "id": context}
    deferred = ask("wait", id=later["id"], status="SUCCESSFUL")
    assert deferred["started_at"] >= deferred["run_after"]  # never early, on the server's clock

    # the default queue's worker left the emails queue's tasks alone
    for key in emails.values():
        waiting = ask("get", id=key)
        assert waiting["status"] == "READY" and waiting["attempts"] == 0
    project.worker("--queue", "emails", "--concurrency", "1", "--prefetch", "0")
    for key in emails.values():
        ask("wait", id=key, status="SUCCESSFUL")
    assert ask("ran")["labels"] == ["high", "middle", "low"]  # higher first, as in Django

    # SIGTERM: the run in flight finishes, then the worker exits
    draining = ask("enqueue", name="hold", args=[release(tmp, "drain")])["id"]
    ask("wait", id=draining, status="RUNNING")
    default.send_signal(signal.SIGTERM)
    Path(release(tmp, "drain")).touch()
    assert ask("wait", id=draining, status="SUCCESSFUL")["attempts"] == 1
    assert default.wait(timeout=60) == 0


def test_a_killed_worker_loses_nothing(project: Project) -> None:
    ask, tmp = project.ask, project.tmp
    held = ask("enqueue", name="hold_short_lease", args=[release(tmp, "kill")])["id"]
    victim = project.worker()
    first = ask("wait", id=held, status="RUNNING")
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=30)
    Path(release(tmp, "kill")).touch()
    project.worker()
    done = ask("wait", id=held, status="SUCCESSFUL")  # its lease ran out: taken over
    assert done["attempts"] == 2 and done["worker_ids"][0] == first["worker_ids"][0]
    assert [e["class"] for e in done["errors"]] == ["mtask.errors.LeaseLost"]


def test_system_checks_and_the_worker_commands_errors(project: Project) -> None:
    assert project.ask("check")["messages"] == []  # replica set reached, indexes made
    unknown = project.manage("mtask_worker", "--queue", "nowhere")
    assert unknown.returncode == 2 and "nowhere" in unknown.stderr
    assert "Traceback" not in unknown.stderr


def test_the_dashboard_behind_djangos_login_for_staff(project: Project) -> None:
    # mtask's app starts with the server's lifespan, or without one at the first request
    base = project.serve("on" if project.leg == "6.1" else "off")  # starts while the probe works
    signed = project.ask("signed_in")
    staff, other = ({"cookie": f"{signed['name']}={signed[who]}"} for who in ("ada", "bob"))
    later = project.ask("enqueue", name="record", args=["later"], using={"run_after_s": 3600})
    key = later["id"]
    project.up(base)
    with httpx.Client(base_url=base, timeout=30) as http:
        assert http.get("/hello/").text == "hello from Django"  # the rest is Django's
        # anonymous: pages to Django's login (and back), the API 401, a bearer token no key
        for page in ("/mtask/", "/mtask/ui/tasks?status=pending"):
            refused = http.get(page)
            login = urllib.parse.urlsplit(refused.headers["location"])
            assert refused.status_code == 302 and login.path == "/accounts/login/"
            assert urllib.parse.parse_qs(login.query) == {"next": [page]}
        for path in (f"/mtask/tasks/{key}", "/mtask/tasks", "/mtask/events"):
            assert http.get(path).status_code == 401
        assert http.get("/mtask/tasks", headers={"authorization": "Bearer x"}).status_code == 401
        assert http.post(f"/mtask/tasks/{key}:cancel", headers={"origin": base}).status_code == 401
        # signed in, not staff: 403
        for path in ("/mtask/", f"/mtask/tasks/{key}"):
            assert http.get(path, headers=other).status_code == 403
        assert (
            http.post(f"/mtask/tasks/{key}:cancel", headers={**other, "origin": base}).status_code
            == 403
        )
        # staff: the dashboard (its links under the prefix) and the REST API
        assert http.get("/mtask", headers=staff).headers["location"] == "/mtask/"
        assert http.get("/mtask/", headers=staff).status_code == 200
        page = http.get("/mtask/ui/tasks", headers=staff)
        assert page.status_code == 200 and key in page.text
        assert 'href="/mtask/ui/tasks/' in page.text and 'href="/ui/' not in page.text
        task = http.get(f"/mtask/tasks/{key}", headers=staff)
        assert task.status_code == 200 and task.json()["status"] == "pending"
        # an action needs the page's origin, and the audit names Django's user
        cancel = f"/mtask/tasks/{key}:cancel"
        assert http.post(cancel, headers=staff).status_code == 403
        assert http.post(cancel, headers={**staff, "origin": "http://evil.test"}).status_code == 403
        done = http.post(cancel, headers={**staff, "origin": base})
        assert done.status_code == 200, done.text
        assert project.ask("get", id=key)["mtask_status"] == "cancelled"
        audit = http.get("/mtask/audit", headers=staff).json()
        assert [(r["who"], r["action"], r["status"]) for r in audit][:1] == [("ada", "cancel", 200)]
