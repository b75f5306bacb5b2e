"""``mtask retry|cancel --name N --status S --older-than 1h [--key K …] [--yes]``: bulk
actions by filter from the command line (``mtask.store.bulk``, as ``POST /tasks:retry`` and
``POST /tasks:cancel``; ``mtask purge`` is ``mtask.cli.retention``'s).

A dry-run count comes first; without ``--yes`` the command asks before it changes anything (and
refuses when stdin is not a terminal). ``add_filters(parser)`` gives the ``retry`` / ``cancel``
parsers of ``mtask.cli.tasks`` the filter options (their KEY becomes optional), and ``run(args)``
runs either with a filter; exit 0 done, 1 declined, 2 bad usage.
"""

from __future__ import annotations

import argparse
import sys

from mtask.cli.common import STATUSES, choose, err, out, parse_duration, task_client
from mtask.errors import UsageError


def duration(text: str) -> float:
    """``--older-than``: ``common.parse_duration`` in seconds, for argparse (exit 2)."""
    try:
        return parse_duration(text, "--older-than").total_seconds()
    except UsageError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_filters(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--name", help="only tasks of this name")
    status = parser.add_argument(
        "--status", action="append", help="only these statuses (repeatable)"
    )
    choose(status, STATUSES)
    parser.add_argument(
        "--older-than", type=duration, help="only tasks unchanged for this long (15m, 2h, 7d)"
    )
    parser.add_argument("--key", action="append", dest="keys", help="only these keys (repeatable)")
    parser.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    parser.add_argument("--dry-run", action="store_true", help="count only, change nothing")


def has_filter(args: argparse.Namespace) -> bool:
    return any(getattr(args, f, None) for f in ("name", "status", "older_than", "keys"))


def run(args: argparse.Namespace) -> int:
    from mtask.store.bulk import Filter

    action = args.command
    if action not in ("retry", "cancel"):
        err.print(f"mtask: {action} is not a bulk action", markup=False)
        return 2
    where = Filter(args.name, args.status, args.older_than, args.keys)
    with task_client(args) as client:
        counted = client.bulk(action, where, dry_run=True)
        out.print(f"{action}: {counted.matched} tasks match", markup=False)
        if args.dry_run or counted.matched == 0:
            return 0
        if not args.yes:
            if not sys.stdin.isatty():
                err.print(f"mtask {action}: not a terminal; pass --yes to {action} them")
                return 1
            answer = input(f"{action} {counted.matched} tasks? [y/N] ")
            if answer.strip().lower() not in ("y", "yes"):
                out.print("nothing changed")
                return 1
        done = client.bulk(action, where)
    more = " (more match: run it again)" if done.truncated else ""
    out.print(f"{action}: {done.changed} of {done.matched} tasks{more}", markup=False)
    return 0
