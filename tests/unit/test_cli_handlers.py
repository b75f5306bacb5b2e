"""Every command the parser offers has a handler: a command that parses and then has nothing to
run (``mtask pause`` did: ``KeyError: 'pause'``) is caught here, not by a user."""

from __future__ import annotations

import argparse

from mtask.cli import build_parser, command_modules
from mtask.cli.common import Commands


def test_every_parsed_command_has_a_handler() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    missing = []
    for register, run in command_modules():
        before = set(sub.choices)
        register(sub)
        added = set(sub.choices) - before
        table = getattr(run, "__self__", None)
        if not isinstance(table, Commands):  # a module of one command runs it (mtask wait)
            assert len(added) == 1, (run, added)
            continue
        missing += [name for name in added if name not in table.handlers]
    assert missing == []


def test_the_parser_of_each_command_alone_runs_its_handler() -> None:
    """``main`` builds the parser of the command's module alone: each command's ``run`` is the
    table that holds it."""
    for name in build_parser()._subparsers._group_actions[0].choices:  # type: ignore[union-attr]
        args = build_parser(name)
        action = next(a for a in args._actions if isinstance(a, argparse._SubParsersAction))
        run = action.choices[name]._defaults["run"]
        table = getattr(run, "__self__", None)
        assert not isinstance(table, Commands) or name in table.handlers, name


def test_the_shared_options_may_come_before_the_command() -> None:
    from mtask.cli import hoisted

    assert hoisted(["--uri", "mongodb://h/", "stats"]) == ["stats", "--uri", "mongodb://h/"]
    assert hoisted(["--database=d", "--json", "get", "k"]) == ["get", "--database=d", "--json", "k"]
    assert hoisted(["get", "k", "--uri", "u"]) == ["get", "k", "--uri", "u"]  # as it was
    assert hoisted(["--uri"]) == ["--uri"]  # argparse says what is missing
    args = build_parser("stats").parse_args(hoisted(["--uri", "mongodb://h/", "stats"]))
    assert (args.command, args.uri) == ("stats", "mongodb://h/")
