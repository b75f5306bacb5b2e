"""The mtask CLI: clear errors, exit status 2 for bad input, nothing written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mtask import TaskClient
from mtask.cli import main

Capsys = pytest.CaptureFixture[str]


def run(capsys: Capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_publish_get_list_stats(
    capsys: Capsys, mongo_uri: str, db_name: str, client: TaskClient
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
    assert json.loads(out) == {"resize": {"scheduled": 1}}  # the derived state, as list says
    code, out, _ = run(capsys, "stats", "--json", "--by", "status", *common)
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
    capsys: Capsys,
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
    capsys: Capsys, mongo_uri: str, db_name: str, client: TaskClient
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
    capsys: Capsys, mongo_uri: str, db_name: str, client: TaskClient
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
    capsys: Capsys, mongo_uri: str, db_name: str, client: TaskClient, tmp_path: Path
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
    assert code == 2 and f"{bad}:1 is not valid JSON" in err
    code, _, err = run(capsys, "publish", "n", *common)
    assert code == 2 and "publish needs NAME and KEY" in err
    assert client.collection.count_documents({}) == 2500  # nothing from the bad files


@pytest.mark.parametrize(
    ("given", "named"),
    [
        (["--supersede", "cancel_queued"], "--supersede"),
        (["--supersede", "drop_newer"], "--supersede"),
        (["--debounce", "5"], "--debounce"),
        (["--debounce", "5", "--debounce-max", "30"], "--debounce, --debounce-max"),
        (["--delay", "5"], "--delay"),
        (["--priority", "3"], "--priority"),
        (["--params", '{"a": 1}'], "--params"),
        (["--options", '{"group": "g"}'], "--options"),
        (["--depends-on", "p1"], "--depends-on"),
        (["--worker", "w1"], "--worker"),
        (["--on-conflict", "reset"], "--on-conflict reset"),
    ],
)
def test_publish_from_a_file_refuses_the_single_publishs_options(
    capsys: Capsys,
    mongo_uri: str,
    db_name: str,
    client: TaskClient,
    tmp_path: Path,
    given: list[str],
    named: str,
) -> None:
    """A per-task option the file's lines cannot take exits 2 naming it, nothing written (it
    was silently ignored, exit 0)."""
    common = ("--uri", mongo_uri, "--database", db_name)
    lines = tmp_path / "tasks.jsonl"
    lines.write_text(json.dumps({"name": "n", "key": "k1"}) + "\n")
    code, _, err = run(capsys, "publish", "--from-file", str(lines), *given, *common)
    assert code == 2 and "Traceback" not in err, err
    assert f"{named} cannot be used with --from-file" in err
    assert client.collection.count_documents({}) == 0
    code, _, _ = run(
        capsys, "publish", "--from-file", str(lines), "--on-conflict", "ignore", *common
    )
    assert code == 0 and client.get("k1") is not None  # the default, what the file does


def test_top_shows_counts_and_workers(
    capsys: Capsys, mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    client.publish_many([{"name": "resize", "key": f"k{i}"} for i in range(3)])
    code, out, _ = run(
        capsys, "top", "--iterations", "2", "--interval", "0.05",
        "--uri", mongo_uri, "--database", db_name,
    )  # fmt: skip
    assert code == 0 and out.count("mtask top") == 2
    assert "resize" in out and "0 workers" in out
    assert "blocked" in out.split("0 workers")[0]  # the derived state: no worker handles it


def test_markup_in_keys_names_and_errors_is_shown_as_text(
    capsys: Capsys, mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    """Keys, names, groups, worker ids and errors are data: ``[/b]`` in one is printed as it
    is, not parsed as rich markup (a MarkupError traceback, after publish/cancel had written)."""
    common = ("--uri", mongo_uri, "--database", db_name)
    options = json.dumps({"group": "g[/g]"})
    code, out, err = run(capsys, "publish", "m[/y]", "pk[/z]", "--options", options, *common)
    assert (code, err) == (0, "") and "created: pk[/z] (m[/y], blocked · no worker)" in out
    now = client.now()
    run_doc = {"run_id": "r1", "worker_id": "w[/w]", "state": "FAIL", "claimed_at": now}
    client.collection.update_one(
        {"_id": "pk[/z]"}, {"$set": {"runs": [run_doc | {"error": "boom[/i]"}]}}
    )
    client.collection.database["workers"].insert_one(
        {"_id": "w[/w]", "names": ["m[/y]"], "last_seen": now, "running": [{"key": "pk[/z]"}]}
    )
    for argv, shown in [
        (["list"], "pk[/z]"),
        (["stats", "--groups", "5"], "g[/g]"),
        (["get", "pk[/z]"], "boom[/i]"),
        (["workers"], "w[/w]"),
        (["top", "--iterations", "1"], "m[/y]"),
        (["cancel", "pk[/z]"], "cancelled: pk[/z]"),
        (["retry", "pk[/z]"], "pending again: pk[/z]"),
    ]:
        code, out, err = run(capsys, *argv, *common)
        assert (code, err) == (0, ""), (argv, err)
        assert shown in out, (argv, out)


def test_json_arguments_python_cannot_read_exit_2(
    capsys: Capsys, mongo_uri: str, db_name: str, client: TaskClient, tmp_path: Path
) -> None:
    """Valid JSON that json.loads still refuses (an int of 5,000 digits, 100,000 nested
    arrays), a file that is not UTF-8, and a line whose delay is a string: one line, exit 2."""
    common = ("--uri", mongo_uri, "--database", db_name)
    client.publish("n", "sig")
    big, deep = "1" * 5000, "[" * 100_000
    for argv, message in [
        (["publish", "n", "k", "--params", f'{{"a": {big}}}'], "--params cannot be read"),
        (["publish", "n", "k", "--params", '{"a":' * 3000], "--params is nested too deeply"),
        (["publish", "n", "k", "--options", deep], "--options is nested too deeply"),
        (["signal", "sig", "s", "--payload", big], "--payload cannot be read"),
        (["signal", "sig", "s", "--payload", deep], "--payload is nested too deeply"),
    ]:
        code, _, err = run(capsys, *argv, *common)
        assert code == 2 and message in err and "Traceback" not in err, (argv, err)
    lines = tmp_path / "tasks.jsonl"
    first = json.dumps({"name": "n", "key": "f1"}) + "\n"
    for content, message in [
        (
            first.encode() + b'{"name":"n","key":"f2","params":{"a":' + big.encode() + b"}}\n",
            ":2 cannot be read",
        ),
        (first.encode() + deep.encode() + b"\n", ":2 is nested too deeply"),
        (first.encode() + b'{"name":"n","key":"f3","delay":"abc"}\n', "delay: must be a number"),
        (first.encode() + b'{"name":"n","key":"\\ud800"}\n', "key: must be valid Unicode"),
        (b"\xff\xfe\n", "not UTF-8"),
    ]:
        lines.write_bytes(content)
        code, _, err = run(capsys, "publish", "--from-file", str(lines), *common)
        assert code == 2 and message in err, (content[:80], err)
    assert [t.key for t in client.list()] == ["sig"]  # nothing written
    assert client.get("sig").signals == []  # type: ignore[union-attr]


def test_durations_and_sequence_numbers_out_of_range_exit_2(
    capsys: Capsys, mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    common = ("--uri", mongo_uri, "--database", db_name)
    client.publish("n", "k")
    code, _, err = run(capsys, "purge", "--older-than", "1000000d", "--dry-run", *common)
    assert code == 2 and "--older-than: '1000000d' is more than 100 years" in err
    code, _, err = run(capsys, "retention", "n", "--failed", "99999999999d", *common)
    assert code == 2 and "--failed: '99999999999d' is more than 100 years" in err
    for argv in (
        ["retry", "--older-than", "99999999999d", "--dry-run"],
        ["cancel", "--older-than", "9" * 400 + "d", "--yes"],
        ["logs", "k", "--after", "100000000000000000000"],
    ):
        with pytest.raises(SystemExit) as exited:
            run(capsys, *argv, *common)
        assert exited.value.code == 2
        err = capsys.readouterr().err
        assert "more than 100 years" in err or "must be 0 to" in err, err
    code, out, _ = run(capsys, "purge", "--older-than", "36500d", "--dry-run", *common)
    assert code == 0 and "0 finished tasks match" in out
    assert client.get("k").status == "pending"  # type: ignore[union-attr]
