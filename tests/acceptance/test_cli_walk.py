"""Every command the README and docs/cli-reference.md show runs: each command of the reference
answers ``--help`` (exit 0, no traceback) and runs with real arguments, and each ``mtask`` line of
the README's shell blocks runs, as a process against a real worker process and mongod, exiting
0 without a traceback (the long-running ones in their bounded forms: ``top --iterations 1``,
``logs --follow`` of a finished task; ``serve``, ``demo``, ``mongod`` and ``worker stop`` have
tests of their own, named in ``ELSEWHERE`` and ``REFERENCE_ELSEWHERE``)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from harness import worker_process
from harness.cli import run_cli
from test_dashboard import wait_until

from mtask import TaskClient
from mtask.cli import build_parser
from mtask.cli.reference import commands

ROOT = Path(__file__).parents[2]
README = (ROOT / "README.md").read_text()

RUN_AS: dict[str, list[str]] = {  # the README's line: what runs (its placeholders filled)
    "mtask publish greet greet-1 --params '{\"name\": \"Ada\"}'": [
        "publish", "add", "greet-1", "--params", '{"a": 1, "b": 2}'
    ],
    "mtask wait greet-1 --timeout 60": ["wait", "greet-1", "--timeout", "60"],
    "mtask get greet-1": ["get", "greet-1"],
    "mtask workers": ["workers"],
    "mtask pause resize_image && mtask resume resize_image": ["pause", "resize_image"],
    "mtask publish NAME KEY --params '{\"a\": 1}' --priority 5 --delay 10": [
        "publish", "add", "walk-2", "--params", '{"a": 1, "b": 1}', "--priority", "5",
        "--delay", "10",
    ],
    "mtask get KEY": ["get", "greet-1"],
    "mtask list --name NAME --status failed": ["list", "--name", "add", "--status", "failed"],
    "mtask stats": ["stats"],
    "mtask top": ["top", "--iterations", "1"],
    "mtask wait KEY --timeout 60": ["wait", "greet-1", "--timeout", "60"],
    "mtask logs KEY --follow": ["logs", "greet-1", "--follow"],
    "mtask signal KEY approved --payload '{\"by\": \"ann\"}'": [
        "signal", "order-9", "approved", "--payload", '{"by": "ann"}'
    ],
    "mtask retry --status failed --name NAME --older-than 1h": [
        "retry", "--status", "failed", "--name", "add", "--older-than", "1h"
    ],
    "mtask limit NAME --concurrency 2 --rate 10/s --group-concurrency 1": [
        "limit", "add", "--concurrency", "2", "--rate", "10/s", "--group-concurrency", "1"
    ],
    "mtask schedule add nightly cleanup --cron '0 3 * * *' --timezone Europe/Paris": [
        "schedule", "add", "nightly", "cleanup", "--cron", "0 3 * * *", "--timezone",
        "Europe/Paris",
    ],
}  # fmt: skip
THEN = {"mtask pause resize_image && mtask resume resize_image": ["resume", "resize_image"]}
"""The second command of a line that holds two."""
ELSEWHERE = {
    "mtask serve": "tests/acceptance/test_deploy.py and test_docs_examples.py start it",
    "mtask serve --port 8080": "likewise",
    "mtask mongod start --data-dir DIR": "tests/acceptance/test_embedded.py",
    "mtask worker stop HOST:PID:ID": "tests/integration/test_cli_ux.py",
}


REFERENCE_RUNS: dict[str, list[list[str]]] = {  # each reference command: what runs, in order
    "mtask cancel": [["cancel", "walk-nap"], ["cancel", "--name", "nap", "--dry-run"]],
    "mtask retry": [["retry", "walk-nap"]],
    "mtask step check": [["step", "check", "workerapp:registry"]],
    "mtask step rename": [
        ["step", "rename", "walk-steps", "charge", "charged"],
        ["step", "rename", "walk-steps", "charged", "charge"],
    ],
    "mtask step drop": [["step", "drop", "walk-steps", "charge"]],
    "mtask step reset": [["step", "reset", "walk-steps", "wait:approved"]],
    "mtask limits": [["limits"]],
    "mtask schedule": [
        ["schedule", "list"],
        ["schedule", "pause", "nightly"],
        ["schedule", "resume", "nightly"],
        ["schedule", "remove", "nightly"],
    ],
    "mtask flow": [["flow", "walk-steps"]],
    "mtask usage": [["usage"], ["usage", "--name", "add"]],
    "mtask budget": [
        ["budget", "set", "--group", "walk", "--tokens", "1000", "--period", "day"],
        ["budget", "list"],
        ["budget", "clear", "--group", "walk"],
    ],
    "mtask triggers": [["triggers"], ["triggers", "list"]],
    "mtask purge": [["purge", "--dry-run"], ["purge", "--key", "walk-done", "--yes"]],
    "mtask retention": [["retention"], ["retention", "nap", "--succeeded", "2d"]],
    "mtask collection init": [["collection", "init", "--operator-indexes"]],
    "mtask collection roles": [["collection", "roles"]],
    "mtask collection key": [["collection", "key", "--key-file", "{master_key}"]],
}
"""The commands of docs/cli-reference.md that the README does not run, with real arguments;
each runs against the walk's worker and mongod, in this order (after the README's lines)."""
LOCAL_RUNS: dict[str, list[list[str]]] = {  # no MongoDB: no --uri
    "mtask completion": [["completion", "bash"], ["completion", "zsh"]],
    "mtask collection schema": [["collection", "schema"], ["collection", "schema", "validator"]],
}
REFERENCE_ELSEWHERE = {
    "mtask serve": ELSEWHERE["mtask serve"],
    "mtask demo": "tests/acceptance/test_process.py::test_demo_runs_and_preempts",
    "mtask mongod": ELSEWHERE["mtask mongod start --data-dir DIR"],
    "mtask worker stop": ELSEWHERE["mtask worker stop HOST:PID:ID"],
    "mtask worker run": "the walk's own worker (harness.spawn_worker runs mtask worker run)",
    "mtask-worker": "tests/acceptance/test_install.py runs the installed script",
}
GROUPS = {"mtask step", "mtask worker", "mtask collection"}
"""Commands that only name their subcommands (each run above)."""


def readme_lines() -> list[str]:
    """Each ``mtask`` line of the README's shell blocks, its comment cut."""
    found = []
    for block in re.findall(r"```sh\n(.*?)```", README, flags=re.S):
        for line in block.splitlines():
            command = line.split("  #", 1)[0].strip()
            if command.startswith("mtask "):
                found.append(command)
    return found


def test_every_readme_command_has_its_run() -> None:
    lines = readme_lines()
    assert lines, "the README shows no mtask command"
    missing = [line for line in lines if line not in RUN_AS and line not in ELSEWHERE]
    assert not missing, f"README commands this test does not run: {missing}"


def readme_commands() -> set[str]:
    """The reference commands the README's lines run (``mtask schedule add`` is ``mtask
    schedule``)."""
    names = {name for name, _, _ in commands(build_parser())}
    ran = set()
    for argv in [*RUN_AS.values(), *THEN.values()]:
        for n in (2, 1):
            if len(argv) >= n and "mtask " + " ".join(argv[:n]) in names:
                ran.add("mtask " + " ".join(argv[:n]))
                break
    return ran


def test_every_reference_command_has_a_real_run() -> None:
    names = [name for name, _, _ in commands(build_parser())]
    covered = readme_commands() | set(REFERENCE_RUNS) | set(LOCAL_RUNS) | set(REFERENCE_ELSEWHERE)
    missing = [n for n in names if n not in covered and n not in GROUPS]
    assert not missing, f"reference commands no test runs with real arguments: {missing}"
    assert not (set(REFERENCE_RUNS) | set(LOCAL_RUNS)) - set(names), "a run of no command"


@pytest.mark.parametrize("name", [name for name, _, _ in commands(build_parser())])
def test_every_reference_command_answers_help(name: str) -> None:
    words = name.split()[1:]
    with pytest.raises(SystemExit) as done:
        run_cli(*words, "--help")
    assert done.value.code == 0, name


def _run(argv: list[str], uri: str | None, db: str) -> subprocess.CompletedProcess[str]:
    where = ["--uri", uri, "--database", db] if uri is not None else []
    return subprocess.run(
        [sys.executable, "-m", "mtask", *argv, *where],
        cwd=ROOT / "tests",
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )


def test_every_readme_command_runs_against_a_worker(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    client.publish("await_approval", "order-9", {"order": 9})
    with worker_process(mongo_uri, db_name, "--concurrency", "2"):
        wait_until(lambda: client.get("order-9").waiting is not None)  # type: ignore[union-attr]
        failures: list[Any] = []
        for line in readme_lines():
            for argv in (RUN_AS.get(line), THEN.get(line)):
                if argv is None:
                    continue
                done = _run(argv, mongo_uri, db_name)
                if done.returncode != 0 or "Traceback" in done.stdout + done.stderr:
                    failures.append((line, done.returncode, done.stdout[-800:], done.stderr))
        assert not failures, failures
        wait_until(lambda: client.get("order-9").status.value == "succeeded")  # type: ignore[union-attr]
    assert client.get("greet-1").result == 3  # type: ignore[union-attr]


def _failed(done: subprocess.CompletedProcess[str]) -> bool:
    return done.returncode != 0 or "Traceback" in done.stdout + done.stderr


# every command of the reference, each a process of its own: 50 s on a quiet machine, twice
# that beside another suite, near the default hang guard of 120 s
@pytest.mark.timeout(600)
def test_every_reference_command_runs_against_a_worker(
    mongo_uri: str, db_name: str, client: TaskClient, tmp_path: Path
) -> None:
    """The reference's commands the README does not show, each with real arguments, against a
    worker process: a parked workflow (``walk-steps``: its step ``charge`` recorded, waiting for
    ``approved``) for the step commands and flow, a sleeping task (``walk-nap``) to cancel,
    retry, a finished one to purge, the README's schedule to list, pause, resume and remove."""
    master_key = tmp_path / "master.key"
    master_key.write_bytes(bytes(range(96)))
    client.publish("await_approval", "walk-steps", {"order": 1})
    client.publish("nap", "walk-nap", {"seconds": 3600})
    client.publish("add", "walk-done", {"a": 1, "b": 1})
    failures: list[Any] = []
    with worker_process(mongo_uri, db_name, "--concurrency", "2"):
        wait_until(lambda: client.get("walk-steps").waiting is not None)  # type: ignore[union-attr]
        wait_until(lambda: client.get("walk-nap").waiting is not None)  # type: ignore[union-attr]
        wait_until(lambda: client.get("walk-done").status.value == "succeeded")  # type: ignore[union-attr]
        schedule = ["schedule", "add", "nightly", "cleanup", "--cron", "0 3 * * *"]
        assert not _failed(_run(schedule, mongo_uri, db_name))
        for name, runs in REFERENCE_RUNS.items():
            for argv in runs:
                filled = [a.format(master_key=master_key) for a in argv]
                done = _run(filled, mongo_uri, db_name)
                if _failed(done):
                    failures.append(
                        (name, filled, done.returncode, done.stdout[-800:], done.stderr)
                    )
        for name, runs in LOCAL_RUNS.items():
            for argv in runs:
                done = _run(argv, None, db_name)
                if _failed(done) or not done.stdout:
                    failures.append((name, argv, done.returncode, done.stdout[-800:], done.stderr))
        assert not failures, failures
        # what the runs did, read back: the step reset reopened the wait (charge kept), the
        # nap's retry after its cancel, the schedule gone, the retention set
        walk = client.get("walk-steps")
        assert walk is not None and walk.status.value == "pending", walk
        nap = client.get("walk-nap")
        assert nap is not None and nap.status.value in ("pending", "running"), nap
    assert client.get("walk-done") is None  # purged
    assert "nightly" not in {s["_id"] for s in client.schedules()}
    assert "nap" in {r["_id"] for r in client.retention()}
