"""The mtask CLI: clear errors, exit status 2 for bad input, nothing written."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from mtask import TaskClient
from mtask.cli import main


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_publish_get_list_stats(
    capsys: pytest.CaptureFixture[str], mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    common = ("--uri", mongo_uri, "--database", db_name)
    code, out, _ = run(
        capsys,
        "publish",
        "resize",
        "img-1",
        "--params",
        '{"w": 10}',
        "--priority",
        "3",
        "--delay",
        "5",
        *common,
    )
    assert code == 0 and "created: img-1" in out
    code, out, _ = run(capsys, "publish", "resize", "img-1", *common)
    assert code == 0 and "exists: img-1" in out
    code, out, _ = run(capsys, "get", "img-1", "--json", *common)
    task = json.loads(out)
    assert task["params"] == {"w": 10} and task["options"]["priority"] == 3
    code, out, _ = run(capsys, "list", "--json", *common)
    assert [t["_id"] for t in json.loads(out)] == ["img-1"]
    code, out, _ = run(capsys, "stats", "--json", *common)
    assert json.loads(out) == {"resize": {"pending": 1}}
    code, out, _ = run(capsys, "cancel", "img-1", *common)
    assert code == 0 and client.get("img-1").status == "cancelled"  # type: ignore[union-attr]
    code, out, _ = run(capsys, "retry", "img-1", *common)
    assert code == 0 and client.get("img-1").status == "pending"  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--params", '{"w":'], "--params is not valid JSON"),
        (["--params", "[1]"], "--params must be a JSON object"),
        (["--options", '{"colour": 1}'], "options.colour: unknown option"),
        (["--max-retries", "-2"], "options.max_retries"),
        (["--delay", "-1"], "delay: must not be negative"),
    ],
)
def test_bad_input_exits_2_and_writes_nothing(
    capsys: pytest.CaptureFixture[str],
    mongo_uri: str,
    db_name: str,
    client: TaskClient,
    args: list[str],
    message: str,
) -> None:
    code, _, err = run(
        capsys, "publish", "n", "k", *args, "--uri", mongo_uri, "--database", db_name
    )
    assert code == 2 and message in err and "Traceback" not in err
    assert client.collection.count_documents({}) == 0


def test_missing_task_and_bad_transition(
    capsys: pytest.CaptureFixture[str], mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    code, _, err = run(capsys, "get", "nope", "--uri", mongo_uri, "--database", db_name)
    assert code == 1 and "no task with key 'nope'" in err
    client.publish("n", "k")
    code, _, err = run(capsys, "retry", "k", "--uri", mongo_uri, "--database", db_name)
    assert code == 1 and "it is pending" in err


def test_unreachable_uri_is_a_clear_error() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mtask.cli",
            "stats",
            "--uri",
            "mongodb://127.0.0.1:9/?serverSelectionTimeoutMS=300",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 1
    assert "cannot reach MongoDB" in proc.stderr and "Traceback" not in proc.stderr
    proc = subprocess.run(
        [sys.executable, "-m", "mtask.cli", "stats", "--uri", "localhost:27017"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 1 and "invalid MongoDB URI" in proc.stderr
