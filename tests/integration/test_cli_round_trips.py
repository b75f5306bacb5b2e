"""What ``mtask get``, ``list`` and ``stats`` ask MongoDB, command by command: one round trip
to calibrate the clock, then their reads; no index read or made (a reader's start-up: bench WST
measures its time, this its round trips)."""

from __future__ import annotations

from typing import Any

import pytest
from harness import Commands

import mtask.client
from mtask import TaskClient
from mtask.cli import main
from mtask.connection.clients import sync_client


@pytest.fixture
def commands(monkeypatch: pytest.MonkeyPatch) -> Commands:
    """Every client the commands make reports to one listener."""
    listener = Commands()

    def listened(uri: str | None = None, **options: Any) -> Any:
        return sync_client(uri, event_listeners=[listener], **options)

    monkeypatch.setattr(mtask.client, "sync_client", listened)
    return listener


def test_get_list_and_stats_calibrate_once_and_make_no_index(
    capsys: pytest.CaptureFixture[str],
    mongo_uri: str,
    db_name: str,
    client: TaskClient,
    commands: Commands,
) -> None:
    client.publish("resize", "img-1")  # a publisher's client made the indexes
    where = ["--uri", mongo_uri, "--database", db_name]
    reads = {
        # the task; the paused names and live workers (its derived state), the limits of its
        # name (an open task: a limit may hold it)
        ("get", "img-1"): ["find tasks", "find controls", "find workers", "find limits"],
        ("list",): ["find tasks", "find controls", "find workers", "find limits"],
        # the names; the open tasks by name and status; the finished ones by status (four) and
        # those of a status no longer known; then what the derived states need, as above
        ("stats",): [
            "distinct tasks",
            "aggregate tasks",
            *["count tasks"] * 5,
            "aggregate tasks",
            "find tasks",
            "find controls",
            "find workers",
            "find limits",
        ],
    }
    for line, expected in reads.items():
        commands.sent.clear()
        assert main([*line, *where]) == 0, line
        sent = [c for c in commands.sent if c != "endSessions"]
        assert sent[0] == "hello" and sent.count("hello") == 1, (line, sent)  # one calibration
        assert sorted(sent[1:]) == sorted(expected), (line, sent)  # no index read or made
    assert "img-1" in capsys.readouterr().out


def test_a_writing_command_still_makes_the_indexes(
    mongo_uri: str, db_name: str, commands: Commands
) -> None:
    """``publish`` (a new database): its client calibrates as a worker does and makes the
    indexes first, as every client but a reader's does."""
    assert main(["publish", "resize", "img-1", "--uri", mongo_uri, "--database", db_name]) == 0
    sent = commands.sent
    assert sent[:3] == ["hello"] * 3, sent
    assert "listIndexes tasks" in sent and "createIndexes tasks" in sent, sent
    assert sent.index("createIndexes tasks") < sent.index("insert tasks"), sent
