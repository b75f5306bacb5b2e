"""``mtask retry|cancel`` with a filter (``mtask.cli.bulk``): bulk actions from the command line,
with a dry-run count first and a refusal without ``--yes`` when nobody can answer."""

from __future__ import annotations

import argparse

import pytest

from mtask import TaskClient
from mtask.cli import build_parser, main
from mtask.cli import bulk as cli_bulk


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def test_bulk_commands(
    client: TaskClient, mongo_uri: str, db_name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    client.publish_many([{"name": "a", "key": f"a{i}"} for i in range(4)])
    client.publish("b", "b0")
    common = ("--uri", mongo_uri, "--database", db_name)
    assert cli_bulk.run(parse("cancel", *common, "--name", "a", "--dry-run")) == 0
    assert "cancel: 4 tasks match" in capsys.readouterr().out
    assert client.stats()["a"] == {"pending": 4}
    assert cli_bulk.run(parse("cancel", *common, "--name", "a")) == 1  # no terminal, no --yes
    assert client.stats()["a"] == {"pending": 4}
    assert cli_bulk.run(parse("cancel", *common, "--name", "a", "--yes")) == 0
    assert "cancel: 4 of 4 tasks" in capsys.readouterr().out
    assert cli_bulk.run(parse("retry", *common, "--key", "a0", "--key", "a1", "--yes")) == 0
    assert client.stats()["a"] == {"pending": 2, "cancelled": 2}
    assert main(["retry", "a2", *common, "--name", "a"]) == 2  # a KEY or a filter, not both
    assert main(["cancel", *common]) == 2  # neither
    assert main(["cancel", "b0", *common]) == 0  # one key, as before
    assert cli_bulk.duration("15m") == 900 and cli_bulk.duration("2h") == 7200
    with pytest.raises(SystemExit):
        parse("cancel", "--older-than", "soon")
