"""``docs/cli-reference.md`` is the parsers': every command, sub-command, argument and option of
``mtask`` and ``mtask-worker`` is on the page, and the page is what ``mtask.cli.reference``
writes from them today."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from mtask.cli import build_parser
from mtask.cli.reference import WORKER_HEADING, commands, render
from mtask.cli.worker import build_parser as worker_parser

PAGE = Path(__file__).parents[2] / "docs" / "cli-reference.md"


def sections() -> dict[str, str]:
    """The page's sections by heading (without its backticks)."""
    parts = re.split(r"^## (.+)$", PAGE.read_text(), flags=re.MULTILINE)
    pairs = zip(parts[1::2], parts[2::2], strict=True)
    return {heading.replace("`", ""): body for heading, body in pairs}


def every_command() -> list[tuple[str, argparse.ArgumentParser]]:
    found = [(sub.prog, sub) for _, _, sub in commands(build_parser())]
    return [*found, (WORKER_HEADING.replace("`", ""), worker_parser())]


def test_the_page_is_what_the_parsers_say_today() -> None:
    assert PAGE.read_text() == render(), (
        "docs/cli-reference.md is stale: python -m mtask.cli.reference > docs/cli-reference.md"
    )


def test_every_command_and_option_is_on_the_page() -> None:
    """Checked from the parsers, apart from how ``render`` lays them out: a command without
    its section, or an option or argument its section does not name, fails."""
    page = sections()
    names = [name for name, _ in every_command()]
    assert len(names) > 25 and {"mtask logs", "mtask signal", "mtask wait", "mtask purge"} <= set(
        names
    )
    missing = []
    for name, parser in every_command():
        body = page.get(name)
        if body is None:
            missing.append(name)
            continue
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
                continue
            words = action.option_strings or [(action.metavar or action.dest).upper()]
            if action.choices is not None and not action.option_strings:
                words = [",".join(action.choices)]
            missing += [f"{name} {w}" for w in words if f"`{w}" not in body and w not in body]
    assert not missing, missing


def test_the_exit_statuses_are_on_the_page() -> None:
    from mtask.cli.common import EXIT_NOT_FOUND, EXIT_STATUSES, EXIT_USAGE

    table = sections()["Exit status"]
    for status, _ in EXIT_STATUSES:
        assert f"\n| {status} | " in table
    assert EXIT_NOT_FOUND == 1 and "no task, schedule or worker" in table
    assert EXIT_USAGE == 2
