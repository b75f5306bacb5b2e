"""docs/publishing.md's Node.js and raw pymongo examples, run as written against a real
``mtask-worker`` (so the contract page stays true)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from test_node import HERE, node_or_skip, spawn, wait_for_worker

from mtask import TaskClient

DOC = HERE.parents[2] / "docs" / "publishing.md"


def example(heading: str, language: str) -> str:
    text = DOC.read_text()
    section = text.split(f"### {heading}", 1)[1]
    found = re.search(rf"```{language}\n(.*?)```", section, re.S)
    assert found, f"no {language} block under {heading}"
    return found.group(1)


def run(command: list[str], code: str, uri: str, db: str) -> list[str]:
    done = subprocess.run(
        command,
        input=code,
        cwd=HERE,
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "MONGODB_URI": uri, "MTASK_DATABASE": db},
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


@pytest.mark.timeout(400)
def test_the_node_and_pymongo_examples_run(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    node = node_or_skip()
    worker = spawn(mongo_uri, db_name)
    try:
        wait_for_worker(client, worker)
        js = example("Node.js (official `mongodb` driver)", "js")
        assert run([node, "--input-type=module"], js, mongo_uri, db_name) == [
            "true",
            "false",
            "succeeded 5",
        ]
        py = example("Python without mtask (raw pymongo)", "python")
        assert run([sys.executable, "-"], py, mongo_uri, db_name) == ["True", "succeeded 9"]
    finally:
        worker.terminate()
        worker.communicate(timeout=30)
    sum2 = client.get("sum-2")
    assert sum2 is not None and sum2.options.priority == 5 and sum2.complete
    assert sum2.runs[0].claimed_at >= sum2.options.run_at  # type: ignore[operator]
