"""The image and docker-compose.yml on a real Docker engine.

The engine and the two images the Dockerfile and the compose file build FROM come from
``../shared/docker/standin-images.sh`` (.ci/run runs it): ``python:3.11-slim`` and ``mongo:7``
are stand-ins built here (Debian's Python 3.11.2; mongod 6.0.5 with mongosh 1.10.6), not the
official images, which cannot be pulled on these machines.

Every container runs on the host network and talks to 127.0.0.1 only (the engine has no bridge;
no docker network is ever created), on ports picked free by the test. Without an engine the
tests fail under CI (``CI=true``) and are skipped with the reason elsewhere.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from needs import missing

from mtask import TaskClient
from mtask.cli.healthcheck import SERVE_LIVENESS_PATH

ROOT = Path(__file__).parents[2]
HOSTNET = Path(__file__).parent / "docker" / "compose.hostnet.yml"
BASES = ("python:3.11-slim", "mongo:7")
LEASE = {"worker_timeout_ms": 3000, "ping_interval_ms": 500}
"""A short lease for the tasks a test kills a worker under (taken over after 3 s, not 30 s)."""

pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.timeout(420)]


def unavailable(reason: str) -> None:
    missing(reason)


def run(args: list[str], timeout: float = 120, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        args, capture_output=True, text=True, check=False, timeout=timeout, **kwargs
    )


def ok(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 0, f"{proc.args}: {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def wait_for(what: str, check: Callable[[], Any], timeout: float = 60, every: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(every)


def http_status(url: str, token: str | None = None) -> int:
    request = urllib.request.Request(url)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


@pytest.fixture(scope="session")
def docker() -> str:
    """Debian's docker CLI (the one .ci/run's engine comes with), or MTASK_TEST_DOCKER."""
    path = os.environ.get("MTASK_TEST_DOCKER") or (
        "/usr/bin/docker" if Path("/usr/bin/docker").exists() else shutil.which("docker")
    )
    if path is None or not os.access(path, os.X_OK):
        unavailable(f"docker is not installed ({path or 'docker'}; apt-get install docker.io)")
        raise AssertionError("unreachable")
    info = run([path, "info", "--format", "{{.ServerVersion}}"], timeout=30)
    if info.returncode != 0:
        unavailable(f"the Docker engine does not answer: {info.stderr.strip()[:200]}")
    for base in BASES:
        if run([path, "image", "inspect", base], timeout=30).returncode != 0:
            unavailable(f"the base image {base} is missing (../shared/docker/standin-images.sh)")
    return path


@dataclass
class Build:
    tag: str
    log: str
    seconds: float


@pytest.fixture(scope="session")
def images(docker: str) -> Iterator[dict[str, Build]]:
    """The Dockerfile built as `docker build` runs it with each builder, as documented (the
    context is the checkout, the network the host's), under tags of this session only."""
    tag = uuid.uuid4().hex[:8]
    builds: dict[str, Build] = {}
    try:
        for builder, flag in (("legacy", "0"), ("buildkit", "1")):
            name = f"mtask-test:{builder}-{tag}"
            extra = ["--progress", "plain"] if flag == "1" else []
            started = time.monotonic()
            proc = run(
                [docker, "build", "--network", "host", *extra, "-t", name, str(ROOT)],
                timeout=400,
                env={**os.environ, "DOCKER_BUILDKIT": flag},
            )
            log = proc.stdout + proc.stderr
            assert proc.returncode == 0, f"docker build ({builder}) failed:\n{log[-4000:]}"
            builds[builder] = Build(name, log, time.monotonic() - started)
        yield builds
    finally:
        for build in builds.values():
            run([docker, "rmi", "-f", build.tag], timeout=60)


def inspect(docker: str, what: str) -> dict[str, Any]:
    found: list[dict[str, Any]] = json.loads(ok(run([docker, "inspect", what], timeout=30)))
    return found[0]


def image_cmd() -> list[str]:
    found = re.search(r"^CMD (\[.*\])$", (ROOT / "Dockerfile").read_text(), flags=re.M)
    assert found
    cmd: list[str] = json.loads(found[1])
    return cmd


# -- the image -------------------------------------------------------------------------------


def test_the_image_builds_with_both_builders_without_a_warning(
    docker: str, images: dict[str, Build]
) -> None:
    assert set(images) == {"legacy", "buildkit"}
    for builder, build in images.items():
        warnings = [line for line in build.log.splitlines() if re.search(r"warn", line, re.I)]
        assert warnings == [], f"{builder}: {warnings}"
        config = inspect(docker, build.tag)["Config"]
        assert config["User"] == "10001:10001", builder  # numeric: runAsNonRoot can check it
        assert config["Healthcheck"]["Test"] == ["CMD", "mtask-healthcheck"]
        assert config["StopSignal"] == "SIGTERM"
        assert config["Cmd"] == image_cmd() and not config.get("Entrypoint")
        assert set(config["ExposedPorts"]) == {"8080/tcp", "9100/tcp"}
    # The user exists in the image (a home, a group), is not root, and owns nothing it runs.
    tag = images["legacy"].tag
    ids = ok(run([docker, "run", "--rm", "--network", "host", tag, "id"], timeout=60))
    assert ids.split()[:2] == ["uid=10001(mtask)", "gid=10001(mtask)"], ids
    owner = ok(
        run(
            [docker, "run", "--rm", "--network", "host", tag, "stat", "-c", "%u",
             "/app", "/opt/mtask/bin/mtask-worker"],
            timeout=60,
        )
    )  # fmt: skip
    assert owner.split() == ["0", "0"]


def test_a_worker_in_the_image_is_pid_1_and_drains_on_docker_stop(
    docker: str, images: dict[str, Build], mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    """The image's CMD (the demo handlers' worker) on the tests' MongoDB: PID 1 of its
    container, healthy by the image's HEALTHCHECK; `docker stop` lets the run in flight that
    fits in --grace finish, releases the one that does not (its retries untouched), and the
    container exits 0. --grace is 5 s here instead of 30 (appended: the last one counts), and
    the metrics listen on a free port of 127.0.0.1 instead of 0.0.0.0:9100 (the host network)."""
    name = f"mtask-test-worker-{uuid.uuid4().hex[:8]}"
    port = free_port()
    cmd = [*image_cmd(), "--uri", mongo_uri, "--database", db_name, "--grace", "5",
           "--metrics-host", "127.0.0.1", "--metrics-port", str(port)]  # fmt: skip
    client.publish("transcode", "long", {"ms": 600_000}, options={"max_retries": 1})
    client.publish("transcode", "short", {"ms": 3000})
    ok(
        run(
            [docker, "run", "-d", "--name", name, "--network", "host", "--health-interval",
             "1s", images["buildkit"].tag, *cmd],
            timeout=60,
        )
    )  # fmt: skip
    try:

        def running() -> bool:
            tasks = [client.get("long"), client.get("short")]
            return all(t is not None and t.status == "running" for t in tasks)

        wait_for("both tasks to run", running, timeout=60)
        state = inspect(docker, name)["State"]
        cmdline = Path(f"/proc/{state['Pid']}/cmdline").read_bytes().split(b"\0")
        assert any(part.endswith(b"/mtask-worker") for part in cmdline[:2]), cmdline
        nspid = next(
            line.split()[1:]
            for line in Path(f"/proc/{state['Pid']}/status").read_text().splitlines()
            if line.startswith("NSpid:")
        )
        assert nspid[-1] == "1", nspid  # the worker itself is PID 1 of the container
        wait_for(
            "the HEALTHCHECK to pass",
            lambda: inspect(docker, name)["State"]["Health"]["Status"] == "healthy",
            timeout=60,
        )
        health = inspect(docker, name)["State"]["Health"]["Log"][-1]["Output"]
        assert f"127.0.0.1:{port}/healthz" in health  # its /healthz, on its --metrics-port
        ok(run([docker, "stop", "-t", "30", name], timeout=60))
        state = inspect(docker, name)["State"]
        logs = run([docker, "logs", name], timeout=30)
        assert state["ExitCode"] == 0 and not state["OOMKilled"], logs.stderr[-2000:]
        # exit code 0: it drained and stopped by itself, before docker's SIGKILL at 30 s (137);
        # the short task finished in the drain and the long one was released (below)
    finally:
        run([docker, "rm", "-f", name], timeout=60)
    short, long = client.get("short"), client.get("long")
    assert short is not None and short.status == "succeeded"  # finished during the drain
    assert long is not None and long.status == "pending"
    assert long.runs[-1].state == "RELEASED" and long.failures == 0
    assert client.workers() == []


def test_serve_in_the_image_stays_healthy_while_mongodb_is_away(
    docker: str, images: dict[str, Build]
) -> None:
    """The image's HEALTHCHECK on `mtask serve` is liveness: it passes with no MongoDB at all,
    while serve's /healthz (readiness) says 503. Serve stops on `docker stop` with status 0."""
    name = f"mtask-test-serve-{uuid.uuid4().hex[:8]}"
    port, nowhere = free_port(), free_port()
    uri = f"mongodb://127.0.0.1:{nowhere}/?serverSelectionTimeoutMS=1000"
    ok(
        run(
            [docker, "run", "-d", "--name", name, "--network", "host", "--health-interval",
             "1s", "-e", "MTASK_API_TOKEN=test-token", images["legacy"].tag,
             "mtask", "serve", "--host", "127.0.0.1", "--port", str(port), "--uri", uri],
            timeout=60,
        )
    )  # fmt: skip
    try:
        wait_for(
            "the HEALTHCHECK to pass",
            lambda: inspect(docker, name)["State"].get("Health", {}).get("Status") == "healthy",
            timeout=60,
        )
        health = inspect(docker, name)["State"]["Health"]["Log"][-1]["Output"]
        assert f"127.0.0.1:{port}{SERVE_LIVENESS_PATH}" in health
        assert http_status(f"http://127.0.0.1:{port}/healthz") == 503
        assert http_status(f"http://127.0.0.1:{port}{SERVE_LIVENESS_PATH}") == 200
        ok(run([docker, "stop", "-t", "20", name], timeout=60))
        state = inspect(docker, name)["State"]
        assert state["ExitCode"] == 0, run([docker, "logs", name], timeout=30).stderr[-2000:]
    finally:
        run([docker, "rm", "-f", name], timeout=60)


# -- docker-compose.yml ----------------------------------------------------------------------


@dataclass
class Stack:
    """docker-compose.yml with the tests' host-network override, as one compose project."""

    docker: str
    compose: str
    project: str
    env: dict[str, str]
    mongo_port: int
    serve_port: int
    token: str = "test-token"
    log: list[str] = field(default_factory=list)

    def __call__(self, *args: str, timeout: float = 180) -> str:
        proc = run(
            [self.compose, "-p", self.project, "-f", str(ROOT / "docker-compose.yml"),
             "-f", str(HOSTNET), *args],
            timeout=timeout, cwd=ROOT, env=self.env,
        )  # fmt: skip
        self.log.append(f"$ compose {' '.join(args)}\n{proc.stdout}{proc.stderr}")
        return ok(proc)

    @property
    def uri(self) -> str:
        return f"mongodb://127.0.0.1:{self.mongo_port}/?replicaSet=rs0"

    def containers(self, service: str, *, all: bool = False) -> list[str]:
        args = [self.docker, "ps", "-q", "--no-trunc"] + (["-a"] if all else [])
        args += ["--filter", f"label=com.docker.compose.project={self.project}"]
        args += ["--filter", f"label=com.docker.compose.service={service}"]
        return ok(run(args, timeout=30)).split()

    def up(self, workers: int) -> None:
        self("up", "-d", "--no-build", "--scale", f"worker={workers}")


@pytest.fixture(scope="module")
def stack(docker: str, images: dict[str, Build]) -> Iterator[Stack]:
    compose = shutil.which("docker-compose")
    if compose is None:
        unavailable("docker-compose is not installed (apt-get install docker-compose)")
        raise AssertionError("unreachable")
    mongo_port, serve_port = free_port(), free_port()
    project = f"mtasktest{uuid.uuid4().hex[:8]}"
    env = {
        **os.environ,
        "MTASK_TEST_MONGO_PORT": str(mongo_port),
        "MTASK_TEST_SERVE_PORT": str(serve_port),
        "MTASK_TEST_IMAGE": images["legacy"].tag,
        "MTASK_TEST_GRACE": "5",
        "MTASK_API_TOKEN": "test-token",
    }
    s = Stack(docker, compose, project, env, mongo_port, serve_port)
    try:
        s.up(workers=2)
        yield s
    finally:
        try:
            s("down", "-v", "--timeout", "30")
        finally:
            # Whatever down left (it failed, or a test did): no container or volume stays.
            for cid in s.containers("worker", all=True) + s.containers("serve", all=True):
                run([docker, "rm", "-f", cid], timeout=60)
            for cid in s.containers("mongo", all=True):
                run([docker, "rm", "-f", cid], timeout=60)
            run([docker, "volume", "rm", "-f", f"{project}_mongo-data"], timeout=60)


@pytest.fixture
def sclient(stack: Stack) -> Iterator[TaskClient]:
    with TaskClient(stack.uri) as c:
        yield c


def status(client: TaskClient, key: str) -> str | None:
    task = client.get(key)
    return None if task is None else task.status


def finished(client: TaskClient, keys: list[str]) -> bool:
    return all(status(client, k) in ("succeeded", "failed") for k in keys)


def test_compose_up_runs_200_tasks_on_two_workers(stack: Stack, sclient: TaskClient) -> None:
    wait_for("two workers", lambda: len(sclient.workers()) == 2, timeout=60)
    keys = [f"r{i}" for i in range(200)]
    items = [{"name": "resize", "key": k, "params": {"ms": 20}} for k in keys]
    assert sclient.publish_many(items) == 200
    wait_for("200 tasks", lambda: sclient.stats().get("resize", {}).get("succeeded") == 200, 120)
    assert all(status(sclient, k) == "succeeded" for k in keys)
    # serve, as composed, answers: its readiness (the compose healthcheck) and its metrics.
    base = f"http://127.0.0.1:{stack.serve_port}"
    wait_for("serve ready", lambda: http_status(f"{base}/healthz") == 200, timeout=60)
    assert http_status(f"{base}/metrics") == 401
    assert http_status(f"{base}/metrics", stack.token) == 200


def test_compose_a_killed_worker_is_taken_over_and_comes_back(
    stack: Stack, sclient: TaskClient
) -> None:
    """kill -9 of the worker holding 12 runs (as the OOM killer would: not `docker kill`,
    which Docker counts as an operator's stop), with a second worker up: the second one (or the
    first, restarted) takes the runs over when their 3 s leases lapse, and the killed container
    is started again by its restart policy."""
    stack.up(workers=1)
    [victim] = stack.containers("worker")
    wait_for("one worker", lambda: len(sclient.workers()) == 1, timeout=60)
    keys = [f"k{i}" for i in range(12)]
    sclient.publish_many(
        # runs long enough to outlast a second worker's start on a busy machine (they must
        # still be running when their holder is killed)
        [{"name": "transcode", "key": k, "params": {"ms": 20_000}, "options": LEASE} for k in keys]
    )

    wait_for(
        "12 runs on the one worker",
        lambda: all(status(sclient, k) == "running" for k in keys),
        timeout=60,
    )
    holders = {t.runs[-1].worker_id for k in keys if (t := sclient.get(k)) is not None}
    assert len(holders) == 1
    stack.up(workers=2)
    wait_for("a second worker", lambda: len(sclient.workers()) == 2, timeout=60)
    os.kill(inspect(stack.docker, victim)["State"]["Pid"], signal.SIGKILL)
    wait_for("the 12 tasks", lambda: finished(sclient, keys), timeout=90)
    for key in keys:
        task = sclient.get(key)
        assert task is not None and task.status == "succeeded", task
        assert task.runs[0].worker_id in holders and task.runs[0].state != "SUCCESS"
        assert task.runs[-1].state == "SUCCESS" and task.runs[-1].worker_id not in holders

    def restarted() -> bool:
        state = inspect(stack.docker, victim)
        return bool(state["RestartCount"] >= 1 and state["State"]["Running"])

    wait_for("the killed worker to come back", restarted, timeout=60)
    assert inspect(stack.docker, victim)["HostConfig"]["RestartPolicy"]["Name"] == "unless-stopped"
    wait_for("two workers again", lambda: len(sclient.workers()) == 2, timeout=60)


def test_compose_stop_worker_drains_and_leaves_nothing_running(
    stack: Stack, sclient: TaskClient
) -> None:
    stack.up(workers=2)
    wait_for("two workers", lambda: len(sclient.workers()) == 2, timeout=60)
    longs = [f"long{i}" for i in range(4)]
    shorts = [f"short{i}" for i in range(4)]
    sclient.publish_many(
        [{"name": "transcode", "key": k, "params": {"ms": 600_000}} for k in longs]
        + [{"name": "transcode", "key": k, "params": {"ms": 2500}} for k in shorts]
    )
    wait_for(
        "8 runs",
        lambda: all(status(sclient, k) == "running" for k in longs + shorts),
        timeout=60,
    )
    workers = stack.containers("worker")
    assert len(workers) == 2
    stack("stop", "worker", timeout=120)
    for cid in workers:
        state = inspect(stack.docker, cid)["State"]
        assert not state["Running"] and state["ExitCode"] == 0, state
    assert stack.containers("worker") == []  # stopped, and not restarted (unless-stopped)
    for key in shorts:
        assert status(sclient, key) == "succeeded"  # finished during the drain
    for key in longs:
        task = sclient.get(key)
        assert task is not None and task.status == "pending", task
        assert task.runs[-1].state == "RELEASED" and task.failures == 0
    assert sclient.list(status="running") == []
    # Both deregistered on their way out (the worker killed in the test before, if any, ages
    # out of the 10 s heartbeat window).
    wait_for("no live worker", lambda: sclient.workers() == [], timeout=15)
    for key in longs:  # not to be run again by the next test's workers
        sclient.cancel(key)


def test_compose_down_and_up_keep_the_data(stack: Stack, sclient: TaskClient) -> None:
    stack.up(workers=2)
    sclient.publish("resize", "kept", {"ms": 1})
    wait_for("the kept task", lambda: status(sclient, "kept") == "succeeded", timeout=60)
    before = sclient.stats(exact=True)
    count = sclient.mongo.mtask.tasks.count_documents({})
    assert before["resize"]["succeeded"] >= 1 and count >= 1
    stack("down", "--timeout", "30")  # no -v: the volume stays
    assert stack.containers("mongo", all=True) == []
    stack.up(workers=2)
    with TaskClient(stack.uri) as again:
        assert again.stats(exact=True) == before
        assert again.mongo.mtask.tasks.count_documents({}) == count
        assert status(again, "kept") == "succeeded"
