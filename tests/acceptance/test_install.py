"""The built wheel, installed (not editable) into fresh venvs: without extras a publisher and a
worker work and ``mtask serve`` names the missing extra; with them the dashboard's static files
and templates are in the wheel. ``.ci/run`` builds the wheelhouse once
(``$MTASK_TEST_WHEELHOUSE``); without it the test builds one (pip's cache makes it quick)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import venv
from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx
import pytest

from mtask import TaskClient, __version__
from mtask.embedded import free_port

ROOT = Path(__file__).parents[2]
TESTS = Path(__file__).parents[1]
# fresh venvs, each installed offline from the wheelhouse: up to a minute each beside another suite
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory: pytest.TempPathFactory) -> Path:
    given = os.environ.get("MTASK_TEST_WHEELHOUSE")
    if given:
        return Path(given)
    house = tmp_path_factory.mktemp("wheels")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--wheel-dir", str(house),
         f"{ROOT}[server,cli,django,fastapi]"],
        check=True, timeout=600,
    )  # fmt: skip
    return house


def make_venv(where: Path, wheelhouse: Path, requirement: str) -> Path:
    venv.create(where, with_pip=True)
    subprocess.run(
        [str(where / "bin" / "python"), "-m", "pip", "install", "--quiet", "--no-index",
         "--find-links", str(wheelhouse), requirement],
        check=True, timeout=600,
    )  # fmt: skip
    return where / "bin"


@pytest.fixture(scope="module")
def lean(wheelhouse: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_venv(tmp_path_factory.mktemp("lean"), wheelhouse, "mtask")


@pytest.fixture(scope="module")
def full(wheelhouse: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_venv(tmp_path_factory.mktemp("full"), wheelhouse, "mtask[server,cli]")


def run(bin_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(bin_dir / args[0]), *args[1:]],
        capture_output=True, text=True, timeout=120, check=False, cwd=TESTS,
        env={"PATH": f"{bin_dir}:/usr/bin:/bin", "PYTHONPATH": str(TESTS)},
    )  # fmt: skip


@pytest.fixture
def stopping() -> Iterator[list[subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=10)


def test_a_lean_install_publishes_and_runs_a_worker(
    lean: Path,
    mongo_uri: str,
    db_name: str,
    client: TaskClient,
    stopping: list[subprocess.Popen[str]],
) -> None:
    missing = run(lean, "python", "-c", "import importlib.util as u; "
                  "print([m for m in ('rich', 'fastapi', 'uvicorn', 'jinja2', 'shtab') "
                  "if u.find_spec(m)])")  # fmt: skip
    assert missing.stdout.strip() == "[]", missing.stdout + missing.stderr
    assert run(lean, "mtask", "--version").stdout.strip() == f"mtask {__version__}"
    assert run(lean, "mtask-worker", "--version").stdout.strip() == f"mtask-worker {__version__}"
    published = run(lean, "python", "-c", "import sys; from mtask import TaskClient; "
                    "c = TaskClient(sys.argv[1], database=sys.argv[2]); "
                    "print(c.publish('add', 'lean', {'a': 2, 'b': 3}).created)",
                    mongo_uri, db_name)  # fmt: skip
    assert published.stdout.strip() == "True", published.stderr
    worker = subprocess.Popen(
        [str(lean / "mtask-worker"), "workerapp:registry", "--uri", mongo_uri,
         "--database", db_name, "--grace", "2"],
        cwd=TESTS, env={"PATH": f"{lean}:/usr/bin:/bin", "PYTHONPATH": str(TESTS)},
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    stopping.append(worker)
    deadline = time.monotonic() + 60
    while (task := client.get("lean")) is None or task.status != "succeeded":
        assert time.monotonic() < deadline and worker.poll() is None, "the lean worker ran nothing"
        time.sleep(0.1)
    assert task.result == 5
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(timeout=30) == 0
    serve = run(lean, "mtask", "serve", "--uri", mongo_uri)
    assert serve.returncode == 2
    assert serve.stderr.strip().count("\n") == 0 and "Traceback" not in serve.stderr
    assert "pip install 'mtask[server]'" in serve.stderr, serve.stderr
    top = run(lean, "mtask", "stats", "--uri", mongo_uri, "--database", db_name)
    assert top.returncode == 2 and "pip install 'mtask[cli]'" in top.stderr, top.stderr
    as_json = run(lean, "mtask", "stats", "--json", "--uri", mongo_uri, "--database", db_name)
    assert as_json.returncode == 0 and '"succeeded": 1' in as_json.stdout, as_json.stderr


def test_the_built_wheel_serves_the_dashboard(
    full: Path, mongo_uri: str, db_name: str, stopping: list[subprocess.Popen[str]]
) -> None:
    assert run(full, "mtask", "--version").returncode == 0
    demo = run(full, "mtask", "demo", "--help")
    assert demo.returncode == 0 and "--seconds" in demo.stdout
    port = free_port()
    serve = subprocess.Popen(
        [str(full / "mtask"), "serve", "--uri", mongo_uri, "--database", db_name,
         "--port", str(port), "--log-level", "warning"],
        env={"PATH": f"{full}:/usr/bin:/bin"}, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    stopping.append(serve)
    deadline = time.monotonic() + 60
    while True:
        try:
            httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2)
            break
        except httpx.HTTPError:
            assert time.monotonic() < deadline and serve.poll() is None, "serve did not start"
            time.sleep(0.1)
    for path in ("/static/style.css", "/static/dashboard.js"):
        response = httpx.get(f"http://127.0.0.1:{port}{path}", timeout=30)
        assert response.status_code == 200, (path, response.status_code)
    serve.send_signal(signal.SIGTERM)
    serve.wait(timeout=30)


INTEGRATIONS = """
import django
from django.conf import settings

settings.configure(
    INSTALLED_APPS=["mtask.contrib.django"] + ([] if django.VERSION >= (6,) else ["django_tasks"]),
    TASKS={"default": {"BACKEND": "mtask.contrib.django.MtaskBackend",
                       "OPTIONS": {"uri": "mongodb://127.0.0.1:1/?replicaSet=none"}}},
    USE_TZ=True,
)
django.setup()
from mtask.contrib.django.compat import task_backends
from mtask.contrib.fastapi import Mtask

backend = task_backends["default"]
print(type(backend).__name__, backend.supports_defer and backend.supports_priority)
print(type(Mtask().router()).__name__)
"""


def test_the_django_and_fastapi_extras_install_from_the_wheel(
    wheelhouse: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """``mtask[django,fastapi]`` from the built wheel: on this Python (3.11) Django 5.2 with the
    django-tasks backport; the backend and the router load (the Django project's own tests,
    tests/integration/test_django.py, run them for real on both legs)."""
    bin_dir = make_venv(
        tmp_path_factory.mktemp("integrations"), wheelhouse, "mtask[django,fastapi]"
    )
    loaded = run(bin_dir, "python", "-c", INTEGRATIONS)
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.split() == ["MtaskBackend", "True", "APIRouter"], loaded.stdout
