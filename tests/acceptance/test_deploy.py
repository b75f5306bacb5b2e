"""The deployment files: the Dockerfile's command run as PID 1 of a new PID namespace (as a
container runs it), docker-compose.yml parsed by docker-compose, and the Kubernetes manifests
validated against the Kubernetes schemas, with the fields that matter checked against the code
(grace periods, probes, ports, metric names, the restricted Pod Security Standard), and the
image's health check read from command lines. tests/acceptance/test_docker.py builds and runs
the image and the compose file on a real Docker engine."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from mtask import TaskClient
from mtask.metrics import DueTasks

ROOT = Path(__file__).parents[2]
TESTS = Path(__file__).parents[1]
K8S = ROOT / "deploy" / "kubernetes"
CI = bool(os.environ.get("CI"))


def need(tool: str, package: str) -> str:
    path = shutil.which(tool)
    if path is None:
        if CI:
            pytest.fail(f"{tool} is missing in CI (apt-get install {package})")
        pytest.skip(f"{tool} is not installed (apt-get install {package})")
    return path


def dockerfile_cmd() -> list[str]:
    found = re.search(r"^CMD (\[.*\])$", (ROOT / "Dockerfile").read_text(), flags=re.M)
    assert found, "the Dockerfile's CMD is in exec form (a JSON array)"
    cmd: list[str] = json.loads(found[1])
    return cmd


def option(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def manifests() -> list[dict[str, Any]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        docs.extend(d for d in yaml.safe_load_all(path.read_text()) if d)
    return docs


def by_kind(kind: str, name: str) -> dict[str, Any]:
    return next(d for d in manifests() if d["kind"] == kind and d["metadata"]["name"] == name)


# -- the image -------------------------------------------------------------------------------


def test_the_dockerfile_builds_a_wheel_and_runs_the_worker_as_pid_1() -> None:
    text = (ROOT / "Dockerfile").read_text()
    stages = re.findall(r"^FROM (\S+)", text, flags=re.M)
    assert len(stages) == 2 and all(s.startswith("python:3.11-slim") for s in stages)
    assert "COPY --from=build /opt/mtask /opt/mtask" in text
    assert re.search(r"^USER 10001:10001$", text, flags=re.M)  # numeric: runAsNonRoot checks it
    assert re.search(r'^HEALTHCHECK .*CMD \["mtask-healthcheck"\]$', text, flags=re.M)
    assert re.search(r"^STOPSIGNAL SIGTERM$", text, flags=re.M)
    assert "ENTRYPOINT" not in text  # no shell, no wrapper: CMD's program is PID 1
    # Nothing only BuildKit understands: the legacy builder (docker-compose 1.29's, any CLI
    # without buildx) builds it too (test_docker.py builds it with both).
    for buildkit_only in ("--mount", "--chmod", "--link", "--secret", "--ssh", "<<", "# syntax"):
        assert buildkit_only not in text, buildkit_only
    cmd = dockerfile_cmd()
    assert cmd[0] == "mtask-worker" and option(cmd, "--metrics-host") == "0.0.0.0"


def test_worker_as_pid_1_drains_and_releases_on_sigterm(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    """The image's CMD, started as PID 1 of a new PID namespace: SIGTERM from outside (what
    `docker stop` and a Kubernetes scale-down send) drains, releases the run (RELEASED, its
    retry budget untouched) and exits 0 within the grace period."""
    if os.geteuid() != 0:
        if CI:
            pytest.fail("CI runs as root: unshare --pid needs it")
        pytest.skip("unshare --pid needs root")
    unshare = need("unshare", "util-linux")
    cmd = dockerfile_cmd()
    program = str(Path(sys.executable).parent / cmd[0])
    args = [program, "workerapp:registry", *cmd[2:]]
    args[args.index("--metrics-port") + 1] = "0"  # any free port: the test does not scrape it
    grace = float(option(args, "--grace"))
    client.publish("sleep", "long", {"seconds": 3600}, options={"max_retries": 1})
    proc = subprocess.Popen(
        [unshare, "--pid", "--fork", "--mount-proc", *args, "--uri", mongo_uri,
         "--database", db_name],
        cwd=TESTS,
        env={**os.environ, "PYTHONPATH": str(TESTS)},
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while (task := client.get("long")) is None or task.status != "running":
            assert time.monotonic() < deadline and proc.poll() is None, "never claimed"
            time.sleep(0.05)
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        assert len(children) == 1
        worker = int(children[0])
        nspid = next(
            line.split()[1:]
            for line in Path(f"/proc/{worker}/status").read_text().splitlines()
            if line.startswith("NSpid:")
        )
        assert nspid[-1] == "1", nspid  # the worker itself is PID 1 in its namespace
        started = time.monotonic()
        os.kill(worker, signal.SIGTERM)
        code = proc.wait(timeout=grace + 30)
        took = time.monotonic() - started
    finally:
        if proc.poll() is None:
            proc.kill()
    _, err = proc.communicate(timeout=10)
    assert code == 0, err
    assert took < grace + 15, took  # drained within its grace (plus the release and exit)
    task = client.get("long")
    assert task is not None and task.status == "pending"
    assert task.runs[0].state == "RELEASED" and task.failures == 0 and task.attempts <= 1
    assert client.workers() == []


# -- docker-compose.yml ----------------------------------------------------------------------


def compose_config(*files: Path, env: dict[str, str] | None = None) -> dict[str, Any]:
    """``docker-compose config`` of ``files`` (none: what `docker-compose up` reads by itself,
    docker-compose.yml and docker-compose.override.yml)."""
    compose = need("docker-compose", "docker-compose")
    proc = subprocess.run(
        [compose, *(a for f in files for a in ("-f", str(f))), "config"],
        capture_output=True,
        text=True,
        check=False,
        cwd=ROOT,
        env={**os.environ, "MTASK_API_TOKEN": "t", **(env or {})},
    )
    assert proc.returncode == 0, proc.stderr
    config: dict[str, Any] = yaml.safe_load(proc.stdout)
    return config


def seconds(duration: str) -> float:
    found = re.fullmatch(r"(?:(\d+)m)?(?:(\d+)s)?", duration)
    assert found and duration, duration
    return int(found[1] or 0) * 60 + int(found[2] or 0)


def test_docker_compose_config_parses_and_is_consistent() -> None:
    config = compose_config()
    worker, serve = config["services"]["worker"], config["services"]["serve"]
    for service in (worker, serve):
        assert "build" in service and isinstance(service["command"], list)  # exec form
        assert "pip" not in " ".join(service["command"])
        assert option(service["command"], "--uri") == "mongodb://mongo:27017/?replicaSet=rs0"
        assert service["stop_signal"] == "SIGTERM"
    for name, service in config["services"].items():
        assert service["restart"] == "unless-stopped", name  # a crashed container comes back
        if name != "mongo":
            assert service["depends_on"]["mongo"]["condition"] == "service_healthy"
    # `--scale worker=N`: nothing a second worker would collide on.
    assert "ports" not in worker and "container_name" not in worker
    # The worker's health is the image's HEALTHCHECK (liveness); serve's is readiness.
    assert "healthcheck" not in worker
    assert serve["healthcheck"]["test"][:2] == ["CMD", "mtask-healthcheck"]
    assert serve["healthcheck"]["test"][2].endswith(":8080/healthz")
    # Published ports come from docker-compose.override.yml; MongoDB (no auth) on loopback only.
    assert config["services"]["mongo"]["ports"] == ["127.0.0.1:27017:27017/tcp"]
    assert serve["ports"] == [{"published": 8080, "target": 8080}]
    grace = float(option(worker["command"], "--grace"))
    assert seconds(worker["stop_grace_period"]) > grace
    assert worker["command"][0] == dockerfile_cmd()[0]
    assert option(worker["command"], "--metrics-host") == "0.0.0.0"
    assert "mongo-data" in config["volumes"]
    readme = (ROOT / "README.md").read_text()
    assert "mongodb://localhost:27017/?directConnection=true" in readme


# -- Kubernetes ------------------------------------------------------------------------------


def test_kubernetes_manifests_validate_against_the_schemas() -> None:
    import kubernetes_validate

    for doc in manifests():
        if doc["apiVersion"].startswith("keda.sh/"):
            continue  # a CRD: no bundled schema; its fields are checked below
        kubernetes_validate.validate(doc, "1.30", strict=True)


def test_the_worker_deployment_outlives_its_grace_and_probes_its_health() -> None:
    spec = by_kind("Deployment", "mtask-worker")["spec"]["template"]["spec"]
    container = spec["containers"][0]
    args = container["command"]
    assert args[0] == dockerfile_cmd()[0]
    assert spec["terminationGracePeriodSeconds"] > float(option(args, "--grace"))
    assert option(args, "--metrics-host") == "0.0.0.0"
    port = int(option(args, "--metrics-port"))
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    for probe in ("readinessProbe", "livenessProbe"):
        assert ports[container[probe]["httpGet"]["port"]] == port
    assert "--cluster-metrics" not in args  # serve exports the cluster gauges, once
    serve = by_kind("Deployment", "mtask-serve")["spec"]["template"]["spec"]["containers"][0]
    assert serve["command"][:2] == ["mtask", "serve"]
    assert serve["readinessProbe"]["httpGet"]["path"] == "/healthz"
    secret = by_kind("Secret", "mtask")
    env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in serve["env"]}
    assert env["MTASK_API_TOKEN"]["name"] == "mtask"
    assert env["MTASK_API_TOKEN"]["key"] in secret["stringData"]


def test_the_autoscalers_read_metrics_the_code_exports() -> None:
    exported = {f.name for f in DueTasks(dict).describe()}
    assert exported == {"mtask_due_tasks", "mtask_oldest_due_age_seconds"}
    keda = by_kind("ScaledObject", "mtask-worker")["spec"]
    assert keda["scaleTargetRef"]["name"] == "mtask-worker"
    queries = [t["metadata"]["query"] for t in keda["triggers"] if t["type"] == "prometheus"]
    used = {m for q in queries for m in re.findall(r"mtask_\w+", q)}
    assert used and used <= exported
    hpa = by_kind("HorizontalPodAutoscaler", "mtask-worker")["spec"]
    assert hpa["scaleTargetRef"]["name"] == "mtask-worker"
    assert {m["external"]["metric"]["name"] for m in hpa["metrics"]} <= exported
