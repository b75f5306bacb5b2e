"""The command-line reference (``docs/cli-reference.md``), written from the parsers themselves:
every command, sub-command, argument and option, with its help, default and choices, and the
exit statuses (``common.EXIT_STATUSES``). ``python -m mtask.cli.reference > docs/cli-reference.md``
writes it; ``tests/unit/test_cli_reference.py`` fails when the page is stale or misses one.

The page is rendered from each parser's actions, not from argparse's ``--help`` text: that
wraps at the terminal's width and changes between Python versions.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator

from mtask.cli.common import EXIT_STATUSES

HEADER = """\
# Command-line reference

<!-- Written by `python -m mtask.cli.reference > docs/cli-reference.md` from the parsers;
tests/unit/test_cli_reference.py fails when it is stale. Edit the parsers' help, not this. -->

Every command of `mtask` and `mtask-worker`, with every option, as the parsers define them
(`mtask COMMAND --help` prints the same). What each command is for, with examples, is in the
[README](../README.md) and the feature pages; how the package is laid out is
in [cli.md](cli.md).

Every command that reads or writes tasks takes `--uri` (else `$MTASK_MONGODB_URI`, else the
embedded MongoDB: the data directory `mtask mongod start --data-dir` remembered for the current
directory, else `./.mtask/mongodb`; a command that has to start it says so on stderr),
`--database` (default `mtask`) and `--collection` (default `tasks`); `--json` prints
machine-readable output instead of tables. Bad input prints one line on stderr and writes
nothing."""


WORKER_HEADING = "`mtask-worker`: the worker process"
"""``mtask-worker``'s heading: "mtask-worker" alone has the anchor of ``mtask worker``'s."""


def render() -> str:
    """The whole page, as ``docs/cli-reference.md`` holds it."""
    from mtask.cli import build_parser
    from mtask.cli.worker import build_parser as worker_parser

    mtask = build_parser()
    lines = [HEADER, "", "## Exit status", "", "| status | meaning |", "| --- | --- |"]
    lines += [f"| {status} | {cell(meaning)} |" for status, meaning in EXIT_STATUSES]
    lines += ["", "## Commands", ""]
    lines += [f"- [`{name}`](#{slug(name)}): {cell(text)}" for name, text, _ in commands(mtask)]
    worker = worker_parser()
    about = (worker.description or "").rstrip(".").lower()
    lines.append(f"- [`mtask-worker`](#{slug(WORKER_HEADING)}): {about} (as `mtask worker run`)")
    for name, text, parser in commands(mtask):
        lines += section(name, text, parser)
    lines += section("mtask-worker", f"{about} (as `mtask worker run`)", worker, WORKER_HEADING)
    return "\n".join(lines) + "\n"


def commands(parser: argparse.ArgumentParser) -> Iterator[tuple[str, str, argparse.ArgumentParser]]:
    """Every command under ``parser``, sub-commands after their command: (its full name, its
    help, its parser)."""
    for action in parser._actions:
        if not isinstance(action, argparse._SubParsersAction):
            continue
        helps = {a.dest: a.help or "" for a in action._choices_actions}
        seen: set[int] = set()
        for name, sub in action.choices.items():
            if id(sub) in seen:  # an alias (mtask steps is mtask step): one section
                continue
            seen.add(id(sub))
            yield sub.prog, helps.get(name, ""), sub
            yield from commands(sub)


def section(
    name: str, text: str, parser: argparse.ArgumentParser, heading: str | None = None
) -> list[str]:
    about = f"{text[:1].upper()}{text[1:]}." if text else ""
    lines = ["", f"## {heading or f'`{name}`'}", "", about, "", "```text", synopsis(name, parser)]
    lines.append("```")
    actions = [a for a in parser._actions if shown(a)]
    shared = [a for a in actions if is_shared(a)]
    rows = [row(a) for a in actions if not a.option_strings]  # positional arguments first
    if shared:
        spelled = ", ".join(spelling(a) for a in shared)
        rows.append(f"| {cell(spelled)} |  | {SHARED_MEANING} |")
    rows += [row(a) for a in actions if a.option_strings and a not in shared]
    if rows:
        lines += ["", "| argument | default | meaning |", "| --- | --- | --- |", *rows]
    return lines


SHARED_MEANING = "where the tasks are, and JSON output (see above)"


def is_shared(action: argparse.Action) -> bool:
    """One of the options every task command shares (``common.add_common``), as declared
    there: shown once per command, in one row."""
    return any(
        action.option_strings == theirs.option_strings and action.help == theirs.help
        for theirs in _shared()
    )


def _shared() -> list[argparse.Action]:
    from mtask.cli.common import add_common

    parser = argparse.ArgumentParser(add_help=False)
    add_common(parser)
    return list(parser._actions)


def shown(action: argparse.Action) -> bool:
    """Every argument but ``-h`` and a sub-command list (its commands have sections)."""
    return not isinstance(action, argparse._HelpAction | argparse._SubParsersAction)


def synopsis(name: str, parser: argparse.ArgumentParser) -> str:
    words = [name]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            words.append("{" + ",".join(action.choices) + "} ...")
        elif not action.option_strings:
            words.append(usage(action))
    if any(a.option_strings and shown(a) for a in parser._actions):
        words.append("[options]")
    return " ".join(words)


def usage(action: argparse.Action) -> str:
    """A positional argument as a synopsis shows it: ``KEY``, ``[KEY]``, ``{bash,zsh}``."""
    word = metavar(action)
    return f"[{word}]" if action.nargs == "?" else word


def metavar(action: argparse.Action) -> str:
    if action.metavar is not None:
        return str(action.metavar)
    if action.choices is not None:
        return "{" + ",".join(str(c) for c in action.choices) + "}"
    return action.dest.upper()


def row(action: argparse.Action) -> str:
    return f"| {cell(spelling(action))} | {cell(default(action))} | {cell(meaning(action))} |"


def spelling(action: argparse.Action) -> str:
    """``--params PARAMS``, ``-f, --follow``, ``KEY``: as it is typed."""
    if not action.option_strings:
        return f"`{usage(action)}`"
    takes = action.nargs != 0
    spelled = ", ".join(
        f"`{o} {metavar(action)}`" if takes else f"`{o}`" for o in action.option_strings
    )
    return spelled + (" (repeatable)" if isinstance(action, argparse._AppendAction) else "")


def default(action: argparse.Action) -> str:
    value = action.default
    if value is None or value is argparse.SUPPRESS or isinstance(value, bool):
        return ""
    return f"`{value}`"


def meaning(action: argparse.Action) -> str:
    text = (action.help or "").replace("%(default)s", str(action.default))
    if isinstance(action, argparse._VersionAction):
        text = text or "print the version and exit"
    return text


def cell(text: str) -> str:
    """Text for a Markdown table's cell: one line, its pipes escaped."""
    return " ".join(text.split()).replace("|", "\\|")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading such as ``mtask worker run`` (in backticks):
    ``mtask-worker-run``."""
    kept = "".join(c for c in heading.lower() if c.isalnum() or c in "-_ ")
    return kept.replace(" ", "-")


if __name__ == "__main__":
    sys.stdout.write(render())
