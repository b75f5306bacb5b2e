"""``mtask logs``: a task's lines and chunks, stored or followed, resumable with ``--after``;
``mtask get`` shows the progress and the output counts."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from typing import Any

import pytest
from harness import running_worker

from mtask import TaskClient
from mtask.cli import main
from mtask.registry import Registry, TaskContext

registry = Registry()


@registry.task("narrate")
async def narrate(params: dict[str, Any], ctx: TaskContext) -> str:
    ctx.progress(0.5, "halfway")
    ctx.log.info("resized", width=640)
    for word in ("hello ", "world"):
        ctx.emit(word)
    ctx.emit(b"!\n")
    ctx.progress(1.0, "done")
    return "ok"


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture
def narrated(mongo_uri: str, db_name: str, client: TaskClient) -> tuple[str, ...]:
    async def work() -> None:
        async with running_worker(registry, mongo_uri, db_name) as (_, events):
            client.publish("narrate", "n", {})
            await events.wait("recorded", key="n")

    asyncio.run(work())
    return ("--uri", mongo_uri, "--database", db_name)


def test_logs_prints_stored_entries_and_resumes_after_a_seq(
    capsys: pytest.CaptureFixture[str], narrated: tuple[str, ...]
) -> None:
    code, out, _ = run(capsys, "logs", "n", *narrated)
    assert code == 0
    lines = out.splitlines()
    assert len(lines) == 4 and "info" in lines[0] and "resized width=640" in lines[0]
    assert "chunk" in lines[1] and lines[1].endswith("hello ")
    code, out, _ = run(capsys, "logs", "n", "--json", "--after", "2", *narrated)
    entries = [json.loads(line) for line in out.splitlines()]
    assert [e["seq"] for e in entries] == [3, 4] and entries[0]["data"] == "world"
    code, out, err = run(capsys, "logs", "n", "--raw", "--follow", *narrated)
    assert (code, out) == (0, "hello world!\n") and "resized width=640" in err
    code, out, _ = run(capsys, "logs", "n", "--kind", "log", "--json", *narrated)
    assert [json.loads(line)["kind"] for line in out.splitlines()] == ["log"]
    code, out, _ = run(capsys, "get", "n", *narrated)
    assert "100% done" in out and "4 entries" in out and "1 line," in out


def test_logs_bad_input_exits_2_and_a_missing_task_1(
    capsys: pytest.CaptureFixture[str], narrated: tuple[str, ...]
) -> None:
    code, _, err = run(capsys, "logs", "n", "--json", "--raw", *narrated)
    assert code == 2 and "--json and --raw" in err
    code, _, err = run(capsys, "logs", "nope", *narrated)
    assert code == 1 and "nope" in err
    code, _, err = run(capsys, "logs", "nope", "--follow", *narrated)
    assert code == 1 and "nope" in err
    proc = subprocess.run(
        [sys.executable, "-m", "mtask", "logs", "n", "--after", "-1", *narrated],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 2 and "must be 0 to 9223372036854775807" in proc.stderr
    assert "Traceback" not in proc.stderr
