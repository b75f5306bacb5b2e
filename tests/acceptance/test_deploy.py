"""The deployment files: the Dockerfile's command run as PID 1 of a new PID namespace (as a
container runs it), docker-compose.yml parsed by docker-compose, and the Kubernetes manifests
validated against the Kubernetes schemas, with the fields that matter checked against the code
(grace periods, probes, ports, metric names, the restricted Pod Security Standard), and the
image's health check read from command lines. tests/acceptance/test_docker.py builds and runs
the image and the compose file on a real Docker engine."""

from __future__ import annotations

import contextlib
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
from harness import tree_env
from needs import missing

from mtask import TaskClient
from mtask.cli.healthcheck import SERVE_LIVENESS_PATH
from mtask.metrics import DueTasks

ROOT = Path(__file__).parents[2]
TESTS = Path(__file__).parents[1]
K8S = ROOT / "deploy" / "kubernetes"


def need(tool: str, package: str) -> str:
    path = shutil.which(tool)
    if path is None:
        missing(f"{tool} is not installed (apt-get install {package})")
    return path


def dockerfile_cmd() -> list[str]:
    found = re.search(r"^CMD (\[.*\])$", (ROOT / "Dockerfile").read_text(), flags=re.M)
    assert found, "the Dockerfile's CMD is in exec form (a JSON array)"
    cmd: list[str] = json.loads(found[1])
    return cmd


def option(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def manifests(folder: Path = K8S) -> list[dict[str, Any]]:
    """Every object of every manifest under ``folder`` (autoscaling/ and monitoring/ too)."""
    docs = []
    for path in sorted(folder.rglob("*.yaml")):
        docs.extend(d for d in yaml.safe_load_all(path.read_text()) if d)
    return docs


def load(path: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((K8S / path).read_text()) if d]


def by_kind(kind: str, name: str, docs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return next(
        d for d in docs or manifests() if d["kind"] == kind and d["metadata"]["name"] == name
    )


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
        missing("unshare --pid needs root")
    unshare = need("unshare", "util-linux")
    cmd = dockerfile_cmd()
    program = str(Path(sys.executable).parent / cmd[0])
    args = [program, "workerapp:registry", *cmd[2:]]
    args[args.index("--metrics-port") + 1] = "0"  # any free port: the test does not scrape it
    grace = float(option(args, "--grace"))
    client.publish("sleep", "long", {"seconds": 3600}, options={"max_retries": 1})
    proc = subprocess.Popen(
        [unshare, "--pid", "--fork", "--kill-child", "--mount-proc", *args, "--uri", mongo_uri,
         "--database", db_name],
        cwd=TESTS,
        env=tree_env(),
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    worker, stacks = None, ""
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
        os.kill(worker, signal.SIGTERM)
        try:
            code = proc.wait(timeout=grace + 30)
        except subprocess.TimeoutExpired:
            stacks = threads_of(worker)  # where its shutdown waits, for the failure below
            code = None
    finally:
        if proc.poll() is None:
            if worker is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(worker, signal.SIGKILL)
            proc.kill()
        _, err = proc.communicate(timeout=10)  # its pipe closed, whatever happened
    assert code is not None, f"not gone {grace + 30:.0f} s after SIGTERM:\n{stacks}\n{err}"
    assert code == 0, err
    # exit 0 and the run RELEASED: it drained within its grace and let the task go (how soon
    # is the bench's to measure: no wall-clock bound in a test)
    task = client.get("long")
    assert task is not None and task.status == "pending"
    assert task.runs[0].state == "RELEASED" and task.failures == 0 and task.attempts <= 1
    assert client.workers() == []


def threads_of(pid: int) -> str:
    """Every thread's Python stack of process ``pid`` (``py-spy dump``), or why not."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    try:
        done = subprocess.run(
            [spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"(no py-spy dump: {exc})"
    return done.stdout + done.stderr


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


# -- the image's health check ----------------------------------------------------------------


def test_the_healthcheck_probes_each_roles_liveness_on_its_port(tmp_path: Path) -> None:
    from mtask.cli.healthcheck import find_command, url_for

    assert url_for(["/usr/bin/python3", "/opt/mtask/bin/mtask-worker", *dockerfile_cmd()[1:]]) == (
        "http://127.0.0.1:9100/healthz"
    )
    assert url_for(["mtask", "serve", "--host", "0.0.0.0"]) == (
        f"http://127.0.0.1:8080{SERVE_LIVENESS_PATH}"
    )
    assert url_for(["python", "-m", "mtask", "serve", "--port=9000", "--host", "10.0.0.5"]) == (
        f"http://10.0.0.5:9000{SERVE_LIVENESS_PATH}"
    )
    assert url_for(["mtask", "worker", "run", "app:r", "--metrics-port", "1", "--metrics-port",
                    "2"]) == "http://127.0.0.1:2/healthz"  # fmt: skip
    assert url_for(["mtask-worker", "app:r"]) is None  # no metrics port: nothing to probe
    assert url_for(["mtask-worker", "app:r", "--metrics-port", "0"]) is None
    with pytest.raises(ValueError):
        url_for(["mtask", "stats"])
    # Every command the deployment files run is one it knows.
    commands = [by_kind("Deployment", n)["spec"]["template"]["spec"]["containers"][0]["command"]
                for n in ("mtask-worker", "mtask-serve")]  # fmt: skip
    assert [url_for(c) for c in commands] == [
        "http://127.0.0.1:9100/healthz",
        f"http://127.0.0.1:8080{SERVE_LIVENESS_PATH}",
    ]
    # PID 1 first; else (docker run --init) the first mtask process.
    proc = tmp_path / "proc"
    for pid, argv in (("1", ["tini", "--", "x"]), ("7", ["mtask", "serve"]), ("30", ["sh"])):
        (proc / pid).mkdir(parents=True)
        (proc / pid / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
    assert find_command(proc) == ["mtask", "serve"]
    (proc / "1" / "cmdline").write_bytes(b"mtask-worker\0app:r\0")
    assert find_command(proc) == ["mtask-worker", "app:r"]


# -- Kubernetes ------------------------------------------------------------------------------

KUBERNETES_VERSIONS = ("1.29", "1.33")
CRDS = ("keda.sh/", "monitoring.coreos.com/")
"""No bundled schema for these: their fields are checked by the tests below."""
IMAGE_USER = re.search(r"^USER (\d+):(\d+)$", (ROOT / "Dockerfile").read_text(), flags=re.M)


def pod_templates() -> list[tuple[str, dict[str, Any]]]:
    """(kind/name, pod spec) of every pod template in the manifests."""
    found = []
    for doc in manifests():
        spec = doc.get("spec", {}).get("template", {}).get("spec")
        if spec is not None:
            found.append((f"{doc['kind']}/{doc['metadata']['name']}", spec))
    return found


RESTRICTED_VOLUMES = {
    "configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
    "projected", "secret",
}  # fmt: skip
BASELINE_CAPABILITIES = {
    "AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
    "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT",
}  # fmt: skip
SAFE_SYSCTLS = {
    "kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
}  # fmt: skip


def restricted_violations(spec: dict[str, Any]) -> list[str]:
    """The rules of the Pod Security Standards' `restricted` profile (which includes
    `baseline`) that ``spec`` breaks, as kubernetes.io/docs/concepts/security/
    pod-security-standards lists them (v1.29 and later), plus the read-only root filesystem
    this project asks of its own pods."""
    containers = [
        *spec.get("initContainers", []),
        *spec.get("containers", []),
        *spec.get("ephemeralContainers", []),
    ]
    out = _pod_violations(spec)
    for context in [spec.get("securityContext", {})]:
        out += _context_violations(context)
    for c in containers:
        out += [f"{c['name']}: {v}" for v in _container_violations(spec, c)]
    return out


def _pod_violations(spec: dict[str, Any]) -> list[str]:
    pod = spec.get("securityContext", {})
    out = [f"{field} is set" for field in ("hostNetwork", "hostPID", "hostIPC") if spec.get(field)]
    if pod.get("windowsOptions", {}).get("hostProcess"):
        out.append("hostProcess")
    out += [
        f"unsafe sysctl {s['name']}"
        for s in pod.get("sysctls", [])
        if s["name"] not in SAFE_SYSCTLS
    ]
    for volume in spec.get("volumes", []):
        kinds = set(volume) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:  # hostPath among them (baseline)
            out.append(f"volume {volume['name']} of type {sorted(kinds)}")
    return out


def _context_violations(context: dict[str, Any]) -> list[str]:
    out = []
    selinux = context.get("seLinuxOptions", {}).get("type")
    if selinux not in (None, "", "container_t", "container_init_t", "container_kvm_t",
                       "container_engine_t"):  # fmt: skip
        out.append(f"SELinux type {selinux}")
    if context.get("seccompProfile", {}).get("type") == "Unconfined":
        out.append("seccomp Unconfined")
    if context.get("appArmorProfile", {}).get("type") == "Unconfined":
        out.append("AppArmor Unconfined")
    if context.get("runAsUser") == 0:
        out.append("runAsUser 0")
    return out


def _container_violations(  # noqa: C901 - one flat check per hardening rule, read as a list
    spec: dict[str, Any], c: dict[str, Any]
) -> list[str]:
    pod = spec.get("securityContext", {})
    sc = c.get("securityContext", {})
    out = _context_violations(sc)
    if sc.get("privileged"):
        out.append("privileged")
    if sc.get("procMount", "Default") != "Default":
        out.append("procMount")
    if any(port.get("hostPort") for port in c.get("ports", [])):
        out.append("hostPort")
    added = set(sc.get("capabilities", {}).get("add", []))
    if not added <= BASELINE_CAPABILITIES:
        out.append(f"adds {sorted(added - BASELINE_CAPABILITIES)}")
    # restricted
    if sc.get("allowPrivilegeEscalation") is not False:
        out.append("allowPrivilegeEscalation is not false")
    non_root = sc.get("runAsNonRoot", pod.get("runAsNonRoot"))
    if non_root is not True:
        out.append("runAsNonRoot is not true")
    seccomp = sc.get("seccompProfile", pod.get("seccompProfile", {})).get("type")
    if seccomp not in ("RuntimeDefault", "Localhost"):
        out.append(f"seccompProfile is {seccomp}")
    if "ALL" not in sc.get("capabilities", {}).get("drop", []):
        out.append("capabilities do not drop ALL")
    if not added <= {"NET_BIND_SERVICE"}:
        out.append("adds capabilities beyond NET_BIND_SERVICE")
    # this project's own rule
    if sc.get("readOnlyRootFilesystem") is not True:
        out.append("root filesystem writable")
    return out


def test_kubernetes_manifests_validate_against_the_schemas() -> None:
    import kubernetes_validate

    validated = 0
    for version in KUBERNETES_VERSIONS:
        for doc in manifests():
            if doc["apiVersion"].startswith(CRDS):
                continue
            kubernetes_validate.validate(doc, version, strict=True)
            validated += 1
    kinds = {d["kind"] for d in manifests() if not d["apiVersion"].startswith(CRDS)}
    assert {"Deployment", "Service", "Secret", "PodDisruptionBudget", "Job", "ConfigMap",
            "HorizontalPodAutoscaler"} <= kinds  # fmt: skip
    assert validated == len(KUBERNETES_VERSIONS) * sum(
        1 for d in manifests() if not d["apiVersion"].startswith(CRDS)
    )


def test_every_pod_meets_the_restricted_pod_security_standard() -> None:
    templates = pod_templates()
    assert {name for name, _ in templates} == {
        "Deployment/mtask-worker", "Deployment/mtask-serve", "Job/mtask-claimable-view",
    }  # fmt: skip
    assert IMAGE_USER, "the Dockerfile's USER is uid:gid, numbers"
    for name, spec in templates:
        assert restricted_violations(spec) == [], name
        # The kubelet checks runAsNonRoot against a number: the image's, or this one.
        context = spec["securityContext"]
        assert (context["runAsUser"], context["runAsGroup"]) == (
            int(IMAGE_USER[1]),
            int(IMAGE_USER[2]),
        ), name
        assert spec["automountServiceAccountToken"] is False, name
        for container in spec["containers"]:
            resources = container["resources"]
            assert {"cpu", "memory"} <= set(resources["requests"]), (name, container["name"])
            assert "memory" in resources["limits"], (name, container["name"])
        # A read-only root: whatever writes /tmp writes to an emptyDir.
        mounts = {m["mountPath"]: m["name"] for c in spec["containers"]
                  for m in c.get("volumeMounts", [])}  # fmt: skip
        if name.startswith("Deployment/"):
            volumes = {v["name"]: v for v in spec["volumes"]}
            assert "emptyDir" in volumes[mounts["/tmp"]], name


def test_the_restricted_checker_finds_what_breaks_the_standard() -> None:
    """The checker above is not an assert of nothing: each rule it checks, broken once."""
    import copy

    good = by_kind("Deployment", "mtask-worker")["spec"]["template"]["spec"]
    assert restricted_violations(good) == []
    breaks: list[tuple[str, Any]] = [
        ("hostNetwork", lambda s: s.update(hostNetwork=True)),
        ("hostPath", lambda s: s["volumes"].append({"name": "h", "hostPath": {"path": "/"}})),
        ("privileged", lambda s: s["containers"][0]["securityContext"].update(privileged=True)),
        ("allowPrivilegeEscalation", lambda s: s["containers"][0]["securityContext"].pop(
            "allowPrivilegeEscalation")),
        ("runAsNonRoot", lambda s: s["securityContext"].pop("runAsNonRoot")),
        ("runAsUser 0", lambda s: s["securityContext"].update(runAsUser=0)),
        ("seccompProfile", lambda s: s["securityContext"].pop("seccompProfile")),
        ("drop ALL", lambda s: s["containers"][0]["securityContext"]["capabilities"].update(
            drop=[])),
        ("adds", lambda s: s["containers"][0]["securityContext"]["capabilities"].update(
            add=["SYS_ADMIN"])),
        ("hostPort", lambda s: s["containers"][0]["ports"][0].update(hostPort=9100)),
        ("root filesystem", lambda s: s["containers"][0]["securityContext"].pop(
            "readOnlyRootFilesystem")),
    ]  # fmt: skip
    for what, breaking in breaks:
        spec = copy.deepcopy(good)
        breaking(spec)
        assert restricted_violations(spec), what


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
    secret = by_kind("Secret", "mtask")
    for name in ("mtask-serve", "mtask-worker"):
        c = by_kind("Deployment", name)["spec"]["template"]["spec"]["containers"][0]
        env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in c["env"]}
        assert env["MTASK_MONGODB_URI"] == {"name": "mtask", "key": "mongodb-uri"}
    serve = by_kind("Deployment", "mtask-serve")["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in serve["env"]}
    assert env["MTASK_API_TOKEN"]["name"] == "mtask"
    assert env["MTASK_API_TOKEN"]["key"] in secret["stringData"]


def test_serve_liveness_reads_no_database_and_readiness_does() -> None:
    """Liveness on a path serve answers without MongoDB (test_docker.py: 200 with MongoDB
    away, in the image); readiness on /healthz (503 while MongoDB is away or not primary)."""
    serve = by_kind("Deployment", "mtask-serve")["spec"]["template"]["spec"]["containers"][0]
    assert serve["command"][:2] == ["mtask", "serve"]
    assert serve["readinessProbe"]["httpGet"]["path"] == "/healthz"
    assert serve["readinessProbe"]["timeoutSeconds"] > 5  # /healthz waits 5 s for MongoDB
    assert serve["livenessProbe"]["httpGet"]["path"] == SERVE_LIVENESS_PATH
    static = ROOT / "mtask" / "web" / "static" / SERVE_LIVENESS_PATH.removeprefix("/static/")
    assert static.is_file()
    from mtask.web.guard import PUBLIC

    assert SERVE_LIVENESS_PATH.startswith(PUBLIC)  # no token needed


def test_disruption_budgets_and_spread_select_their_pods() -> None:
    for name in ("mtask-worker", "mtask-serve"):
        deployment = by_kind("Deployment", name)
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        pdb = by_kind("PodDisruptionBudget", name)["spec"]
        assert pdb["selector"]["matchLabels"].items() <= labels.items()
        assert pdb["maxUnavailable"] == 1 and "minAvailable" not in pdb  # drains never block
        spread = deployment["spec"]["template"]["spec"]["topologySpreadConstraints"]
        assert spread and all(s["labelSelector"]["matchLabels"].items() <= labels.items()
                              for s in spread)  # fmt: skip
        rolling = deployment["spec"]["strategy"]["rollingUpdate"]
        assert rolling["maxUnavailable"] == 0


def test_prometheus_scrapes_serve_with_its_token() -> None:
    service = by_kind("Service", "mtask-serve")
    monitor = by_kind("ServiceMonitor", "mtask-serve")["spec"]
    assert monitor["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    [endpoint] = monitor["endpoints"]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert endpoint["path"] == "/metrics"
    assert endpoint["authorization"] == {
        "type": "Bearer", "credentials": {"name": "mtask", "key": "api-token"},
    }  # fmt: skip
    pods = by_kind("PodMonitor", "mtask-worker")["spec"]
    worker = by_kind("Deployment", "mtask-worker")["spec"]["template"]
    assert pods["selector"]["matchLabels"].items() <= worker["metadata"]["labels"].items()
    ports = {p["name"] for p in worker["spec"]["containers"][0]["ports"]}
    assert {e["port"] for e in pods["podMetricsEndpoints"]} <= ports


def keda_objects(path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    docs = load(f"autoscaling/{path}")
    return by_kind("ScaledObject", "mtask-worker", docs)["spec"], by_kind(
        "TriggerAuthentication", "mtask-mongodb", docs
    )["spec"]


def view_spec() -> dict[str, Any]:
    config = by_kind("ConfigMap", "mtask-claimable-view")
    spec: dict[str, Any] = json.loads(config["data"]["claimable-view.json"])
    return spec


def test_keda_counts_the_claimable_view_and_its_cooldown_does_what_it_says() -> None:
    view = view_spec()
    job = by_kind("Job", "mtask-claimable-view")["spec"]["template"]["spec"]["containers"][0]
    database = next(e["value"] for e in job["env"] if e["name"] == "MTASK_DATABASE")
    for path in ("keda.yaml", "keda-scale-to-zero.yaml"):
        spec, auth = keda_objects(path)
        assert spec["scaleTargetRef"]["name"] == "mtask-worker"
        [trigger] = spec["triggers"]
        assert trigger["type"] == "mongodb"
        meta = trigger["metadata"]
        assert (meta["dbName"], meta["collection"]) == (database, view["view"])
        assert json.loads(meta["query"]) == {}
        assert int(meta["queryValue"]) > 0
        assert trigger["authenticationRef"]["name"] == "mtask-mongodb"
        assert auth["secretTargetRef"] == [
            {"parameter": "connectionString", "name": "mtask", "key": "mongodb-uri"}
        ]
        window = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]
        assert window["stabilizationWindowSeconds"] > 0
    spec, _ = keda_objects("keda.yaml")
    # cooldownPeriod only times the step from 1 to 0: with a floor of 1 it would do nothing.
    assert spec["minReplicaCount"] >= 1 and "cooldownPeriod" not in spec
    text = " ".join((K8S / "autoscaling" / "keda.yaml").read_text().replace("#", " ").split())
    assert "cooldownPeriod does nothing" in text and "stabilization window" in text
    spec, _ = keda_objects("keda-scale-to-zero.yaml")
    assert spec["minReplicaCount"] == 0 and spec["cooldownPeriod"] > 0
    assert "trade-off" in (K8S / "autoscaling" / "keda-scale-to-zero.yaml").read_text()
    # The HPA without KEDA reads a metric the code exports, and says what it counts.
    exported = {f.name for f in DueTasks(dict).describe()}
    hpa = by_kind("HorizontalPodAutoscaler", "mtask-worker")["spec"]
    assert hpa["scaleTargetRef"]["name"] == "mtask-worker"
    assert {m["external"]["metric"]["name"] for m in hpa["metrics"]} <= exported
    assert "paused names too" in (K8S / "autoscaling" / "hpa.yaml").read_text()


def create_view(uri: str, database: str, tmp_path: Path) -> str:
    """Run the Job's own command here: the view, from the ConfigMap's file."""
    job = by_kind("Job", "mtask-claimable-view")["spec"]["template"]["spec"]["containers"][0]
    spec_file = tmp_path / "claimable-view.json"
    spec_file.write_text(
        by_kind("ConfigMap", "mtask-claimable-view")["data"]["claimable-view.json"]
    )
    assert job["command"][:2] == ["python", "-c"]
    proc = subprocess.run(
        [sys.executable, "-c", job["command"][2]],
        env={**os.environ, "MTASK_MONGODB_URI": uri, "MTASK_DATABASE": database,
             "MTASK_VIEW_SPEC": str(spec_file)},
        capture_output=True, text=True, check=False, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_the_keda_signal_counts_claimable_tasks_only(
    mongo_uri: str, db_name: str, client: TaskClient, tmp_path: Path
) -> None:
    """The view KEDA counts, created by the Job's command on the tests' MongoDB and counted as
    KEDA's MongoDB scaler counts (countDocuments with the trigger's query): due tasks of names
    not paused; not the paused names' (mtask_due_tasks counts those), not the delayed ones, not
    finished ones."""
    from mtask.store.depth import DUE_PIPELINE

    view = view_spec()
    assert view["pipeline"][0] == DUE_PIPELINE[0]  # "due" as the code decides it
    spec, _ = keda_objects("keda.yaml")
    query = json.loads(spec["triggers"][0]["metadata"]["query"])
    client.publish_many(
        [{"name": "a", "key": f"a{i}", "params": {}} for i in range(5)]
        + [{"name": "b", "key": f"b{i}", "params": {}} for i in range(60)]
        + [{"name": "a", "key": f"late{i}", "params": {}, "delay": 3600} for i in range(7)]
    )
    client.cancel("a0")
    assert "view mtask_claimable" in create_view(mongo_uri, db_name, tmp_path)
    counted = client.mongo[db_name][view["view"]]

    def keda() -> int:
        return counted.count_documents(query)

    assert keda() == 4 + 60
    client.pause("b")
    assert client.due()["b"][0] == 60  # the Prometheus gauge would still scale on these
    assert keda() == 4
    client.pause("a")
    assert keda() == 0
    client.resume("a")
    client.resume("b")
    assert keda() == 64
    # Run again (the Job after a change): the view is replaced, not doubled or refused.
    create_view(mongo_uri, db_name, tmp_path)
    assert keda() == 64
    views = list(client.mongo[db_name].list_collections(filter={"type": "view"}))
    assert [(v["name"], v["options"]["viewOn"]) for v in views] == [(view["view"], "tasks")]


# -- docs/deploy.md --------------------------------------------------------------------------


def test_the_deployment_guide_is_linked_and_covers_what_an_operator_needs() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "(docs/deploy.md)" in readme
    guide = " ".join((ROOT / "docs" / "deploy.md").read_text().split())
    for topic in ("## The image's contract", "## MongoDB for production", "## Upgrades",
                  "Authentication", "TLS", "w=majority", "Backups", "oplog", "Rolling upgrade",
                  "schema", "stand-in", "10001:10001", "STOPSIGNAL SIGTERM",
                  SERVE_LIVENESS_PATH):  # fmt: skip
        assert topic in guide, topic
    # Its paths exist.
    for path in re.findall(r"`((?:deploy|tests)/[\w./-]+)`", guide):
        assert (ROOT / path).exists(), path
