"""The command line's rough edges: one exit status for "not found", tables
that read at 80 columns, an empty ``stats`` that says so, ``logs --follow`` saying where the task
is and how it ended, a signal's "not found" said once."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from typing import Any

import pytest
from harness import running_worker

from mtask import TaskClient
from mtask.cli import main
from mtask.registry import Registry, TaskContext

registry = Registry()


@registry.task("approve_then_finish")
async def approve_then_finish(params: dict[str, Any], ctx: TaskContext) -> str:
    ctx.log.info("asking")
    approval = await ctx.wait_for("go")
    ctx.log.info("approved", by=approval["by"])
    return str(approval["by"])


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def cli_at_80(*argv: str) -> subprocess.CompletedProcess[str]:
    """The CLI in a process of its own, as in a pipe or CI: 80 columns."""
    return subprocess.run(
        [sys.executable, "-m", "mtask.cli", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "COLUMNS": "80"},
    )


def test_not_found_is_one_exit_status_for_every_command(
    capsys: pytest.CaptureFixture[str], mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    """``get`` exited 1 and ``wait`` 2 for a key no task has; now every command exits
    ``EXIT_NOT_FOUND`` (1) with one line naming what is missing, and a signal to no task says
    so once (it said ``no task with key "no task with key 'nope'"``)."""
    common = ("--uri", mongo_uri, "--database", db_name)
    for argv, missing in [
        (["get", "nope"], "no task with key 'nope'"),
        (["wait", "nope", "--timeout", "5"], "no task with key 'nope'"),
        (["logs", "nope"], "no task with key 'nope'"),
        (["logs", "nope", "--follow"], "no task with key 'nope'"),
        (["signal", "nope", "approved"], "no task with key 'nope'"),
        (["flow", "nope"], "no task with key 'nope'"),
        (["cancel", "nope"], "no task with key 'nope'"),
        (["retry", "nope"], "no task with key 'nope'"),
        (["schedule", "pause", "nope"], "no schedule 'nope'"),
        (["schedule", "remove", "nope"], "no schedule 'nope'"),
        (["worker", "stop", "nope"], "no worker 'nope' is registered"),
    ]:
        code, out, err = run(capsys, *argv, *common)
        assert (code, out) == (1, ""), (argv, code, out)
        assert err.strip() == f"mtask: {missing}" or missing in err, (argv, err)
        assert err.count("no task with key") <= 1 and err.count("\n") == 1, (argv, err)
    from mtask.cli.common import EXIT_NOT_FOUND

    assert EXIT_NOT_FOUND == 1


def test_an_empty_stats_says_so(
    capsys: pytest.CaptureFixture[str], mongo_uri: str, db_name: str
) -> None:
    code, out, err = run(capsys, "stats", "--uri", mongo_uri, "--database", db_name)
    assert (code, err) == (0, "")
    assert out == f"no tasks yet in {db_name}.tasks (mtask publish NAME KEY publishes one)\n"
    code, out, _ = run(capsys, "stats", "--json", "--uri", mongo_uri, "--database", db_name)
    assert (code, out) == (0, "{}\n")


def test_stats_and_top_read_whole_at_80_columns(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    """At 80 columns (a pipe, CI) ``stats`` and ``top`` cut names and headers short
    ("always_…", "succee…"): a status no task is in now takes no column, and a name folds
    rather than being cut."""
    long_names = ["report_generation_monthly_for_customers", "always_fails_permanently"]
    for name in long_names:
        client.publish(name, f"{name}-1")
        client.publish(name, f"{name}-2")
        client.cancel(f"{name}-2")
    common = ("--uri", mongo_uri, "--database", db_name)
    stats = cli_at_80("stats", *common)
    top = cli_at_80("top", "--iterations", "1", *common)
    for shown in (stats, top):
        assert shown.returncode == 0, shown.stderr
        lines = shown.stdout.splitlines()
        assert all(len(line) <= 80 for line in lines), shown.stdout
        assert "…" not in shown.stdout, shown.stdout
        for name in long_names:
            assert any(line.startswith(name + " ") for line in lines), (name, shown.stdout)
        header = next(line for line in lines if line.startswith("name "))
        assert header.split()[1:3] == ["blocked", "cancelled"], header  # no worker handles them
    assert "none scheduled, available, running, retrying, waiting," in stats.stdout
    assert stats.stdout.splitlines()[0].split() == ["name", "blocked", "cancelled", "total"]
    by_status = cli_at_80("stats", "--by", "status", *common)
    assert by_status.stdout.splitlines()[0].split() == ["name", "pending", "cancelled", "total"]
    row = next(line for line in stats.stdout.splitlines() if line.startswith(long_names[0]))
    assert row.split()[1:] == ["1", "1", "2"]


async def test_logs_follow_says_where_the_task_is_and_how_it_ended(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    """``mtask logs KEY --follow`` on a task that waits for a signal printed nothing until it
    finished (maybe hours later), and nothing at its end. Now stderr says it waits, for what,
    and how it ended; stdout holds only the entries."""
    client.publish("approve_then_finish", "order-1")
    follower = subprocess.Popen(  # noqa: ASYNC220 - started once; its pipes are read in a thread
        [sys.executable, "-m", "mtask.cli", "logs", "order-1", "--follow",
         "--uri", mongo_uri, "--database", db_name],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "COLUMNS": "80"},
    )  # fmt: skip
    try:
        async with running_worker(registry, mongo_uri, db_name):
            assert follower.stderr is not None
            said = []
            while "waiting for the signal" not in (line := await asyncio.to_thread(
                follower.stderr.readline
            )):  # fmt: skip
                assert line, f"the follower ended first: {said}"
                said.append(line)
            assert line.startswith("mtask: order-1 is waiting for the signal 'go' (step 1")
            assert line.rstrip().endswith("no deadline"), line
            client.signal("order-1", "go", {"by": "ann"})
            out, rest = await asyncio.to_thread(follower.communicate, timeout=60)
    finally:
        if follower.poll() is None:
            follower.kill()
            follower.communicate()
    assert follower.returncode == 0, rest
    assert rest.splitlines()[-1] == "mtask: order-1 succeeded after 2 runs", rest
    assert "Traceback" not in rest
    lines = out.splitlines()  # the second run replays the handler from the top: asks again
    assert [line.split(None, 4)[-1] for line in lines] == ["asking", "asking", "approved by=ann"]
