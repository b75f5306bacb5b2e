"""The mtask CLI: clear errors, exit status 2 for bad input, nothing written."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

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


def test_limits_schedules_and_flows_from_the_command_line(
    capsys: pytest.CaptureFixture[str], mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    common = ("--uri", mongo_uri, "--database", db_name)
    code, out, _ = run(capsys, "limit", "mail", "--concurrency", "3", "--rate", "600/m", *common)
    assert code == 0 and "at most 3 at once, 10/s" in out
    code, out, _ = run(capsys, "limits", "--json", *common)
    [limit] = json.loads(out)
    assert (limit["_id"], limit["concurrency"], limit["rate"]) == ("mail", 3, 10.0)
    code, _, err = run(capsys, "limit", "mail", "--rate", "lots", *common)
    assert code == 2 and "rate: 'lots' is not a rate like 10/s" in err
    code, out, _ = run(capsys, "limit", "mail", "--clear", *common)
    assert code == 0 and client.limits() == []

    code, out, _ = run(
        capsys, "schedule", "add", "hourly", "report", "--cron", "0 * * * *",
        "--timezone", "Europe/Paris", "--params", '{"kind": "sales"}', *common,
    )  # fmt: skip
    assert code == 0 and "schedule hourly: next tick" in out
    code, _, err = run(capsys, "schedule", "add", "bad", "report", "--cron", "99 * * * *", *common)
    assert code == 2 and "cron: '99 * * * *' is not a cron expression" in err
    code, out, _ = run(capsys, "schedule", "pause", "hourly", *common)
    assert code == 0 and "paused: hourly" in out
    code, out, _ = run(capsys, "schedule", "list", *common)
    assert code == 0 and "hourly" in out
    code, out, _ = run(capsys, "schedule", "list", "--json", *common)
    [schedule] = json.loads(out)
    assert schedule["paused"] is True and schedule["timezone"] == "Europe/Paris"
    assert schedule["params"] == {"kind": "sales"}
    code, _, err = run(capsys, "schedule", "resume", "nope", *common)
    assert code == 1 and "no schedule 'nope'" in err
    code, out, _ = run(capsys, "schedule", "remove", "hourly", *common)
    assert code == 0 and client.schedules() == []

    code, out, _ = run(capsys, "publish", "ship", "s1", "--depends-on", "p1", *common)
    assert code == 0
    client.publish("pack", "p1")
    code, out, _ = run(capsys, "get", "s1", *common)
    assert "depends on" in out and "p1 (waiting on p1)" in out
    code, out, _ = run(capsys, "flow", "s1", "--json", *common)
    assert json.loads(out)["waiting_on"] == ["p1"]
    code, _, err = run(capsys, "flow", "nope", *common)
    assert code == 1 and "no task with key 'nope'" in err


def test_publish_from_a_file_of_json_lines(
    capsys: pytest.CaptureFixture[str],
    mongo_uri: str,
    db_name: str,
    client: TaskClient,
    tmp_path: Any,
) -> None:
    common = ("--uri", mongo_uri, "--database", db_name)
    good = tmp_path / "tasks.jsonl"
    lines = [json.dumps({"name": "n", "key": f"k{i}", "params": {"i": i}}) for i in range(2500)]
    good.write_text("\n".join(lines[:10]) + "\n\n" + "\n".join(lines[10:]) + "\n")
    code, out, _ = run(capsys, "publish", "--from-file", str(good), "--json", *common)
    assert code == 0 and json.loads(out) == {"created": 2500, "given": 2500}
    bad = tmp_path / "bad.jsonl"
    bad.write_text(lines[0] + "\n\n" + json.dumps({"name": "n", "key": ""}) + "\n")
    code, _, err = run(capsys, "publish", "--from-file", str(bad), *common)
    assert code == 2 and f"{bad}:3: key: must not be empty" in err
    bad.write_text("{oops\n")
    code, _, err = run(capsys, "publish", "--from-file", str(bad), *common)
    assert code == 2 and f"{bad}:1: not valid JSON" in err
    code, _, err = run(capsys, "publish", "n", *common)
    assert code == 2 and "publish needs NAME and KEY" in err
    assert client.collection.count_documents({}) == 2500  # nothing from the bad files


def test_top_shows_counts_and_workers(
    capsys: pytest.CaptureFixture[str], mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    client.publish_many([{"name": "resize", "key": f"k{i}"} for i in range(3)])
    code, out, _ = run(
        capsys, "top", "--iterations", "2", "--interval", "0.05",
        "--uri", mongo_uri, "--database", db_name,
    )  # fmt: skip
    assert code == 0 and out.count("mtask top") == 2
    assert "resize" in out and "0 worker(s)" in out
