"""Every command the README and docs/cli-reference.md show runs: each command of the reference
answers ``--help`` (exit 0, no traceback), and each ``mtask`` line of the README's shell blocks
runs, with real arguments, as a process against a real worker process and mongod, exiting 0
without a traceback (the long-running ones in their bounded forms: ``top --iterations 1``,
``logs --follow`` of a finished task; ``serve`` and ``mongod start`` have tests of their own,
named in ``ELSEWHERE``)."""

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


@pytest.mark.parametrize("name", [name for name, _, _ in commands(build_parser())])
def test_every_reference_command_answers_help(name: str) -> None:
    words = name.split()[1:]
    with pytest.raises(SystemExit) as done:
        run_cli(*words, "--help")
    assert done.value.code == 0, name


def _run(argv: list[str], uri: str, db: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mtask", *argv, "--uri", uri, "--database", db],
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
