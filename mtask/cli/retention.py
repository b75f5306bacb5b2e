"""``mtask purge`` (remove finished tasks now) and ``mtask retention`` (how long finished tasks
are kept, per name).

``mtask purge`` counts first (``--dry-run`` stops there), then asks for confirmation on a
terminal (``--yes`` skips it; without a terminal ``--yes`` is required). It never removes an
open task: the delete's own filter names the finished statuses. Bad input exits 2.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from mtask.cli.common import (
    Choices,
    Commands,
    add_common,
    choose,
    out,
    parse_duration,
    print_json,
    task_client,
)
from mtask.errors import UsageError


def _purgeable() -> tuple[str, ...]:
    from mtask.store.retention import PURGEABLE

    return tuple(PURGEABLE)


def _forever() -> int:
    from mtask.vocabulary import FOREVER

    return FOREVER


commands = Commands()
run = commands.run


def parse_keep(text: str | None, what: str) -> int | None:
    """A retention: a duration, or ``forever``; in ms (-1: forever)."""
    if text is None:
        return None
    if text.strip().lower() == "forever":
        return _forever()
    return round(parse_duration(text, what).total_seconds() * 1000)


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "purge", help="remove finished tasks now (counts first, then asks; never open ones)"
    )
    add_common(p)
    p.add_argument("--name", help="only tasks of this name")
    status = p.add_argument(
        "--status",
        action="append",
        help="only this status (repeat; default succeeded, failed and cancelled)",
    )
    choose(status, Choices(_purgeable))
    p.add_argument("--older-than", help="finished at least this long ago (e.g. 7d, 12h)")
    p.add_argument("--key", action="append", dest="keys", help="only this task (repeat)")
    p.add_argument("--dry-run", action="store_true", help="count, remove nothing")
    p.add_argument("--yes", action="store_true", help="do not ask for confirmation")

    p = subparsers.add_parser(
        "retention", help="how long finished tasks are kept, per name ('*': every name)"
    )
    add_common(p)
    p.add_argument("name", nargs="?", help="a task name, or '*' for the global default")
    for status in ("succeeded", "failed", "cancelled"):
        p.add_argument(f"--{status}", help=f"keep {status} tasks this long (7d, 12h, forever)")
    p.add_argument("--clear", action="store_true", help="remove the name's defaults")


def _confirm(count: int) -> bool:
    if not sys.stdin.isatty():
        raise UsageError(f"{count} tasks would be removed; pass --yes to remove them")
    answer = input(f"remove {count} finished tasks? [y/N] ")
    return answer.strip().lower() in ("y", "yes")


@commands.command("purge")
def cmd_purge(args: argparse.Namespace) -> int:
    older = parse_duration(args.older_than, "--older-than") if args.older_than else None
    filters: dict[str, Any] = {
        "name": args.name,
        "status": args.status,
        "older_than": older,
        "keys": args.keys,
    }
    with task_client(args) as client:
        count = client.purge(**filters, dry_run=True)
        if args.dry_run or count == 0 or not (args.yes or _confirm(count)):
            _report(args, matched=count, removed=0)
            return 0
        removed = client.purge(**filters)
    _report(args, matched=count, removed=removed)
    return 0


def _report(args: argparse.Namespace, *, matched: int, removed: int) -> None:
    if args.json:
        sys.stdout.write(f'{{"matched": {matched}, "removed": {removed}}}\n')
    elif args.dry_run:
        out.print(f"{matched} finished tasks match (dry run: nothing removed)")
    else:
        out.print(f"{matched} finished tasks matched, {removed} removed")


@commands.command("retention")
def cmd_retention(args: argparse.Namespace) -> int:
    values = {
        s: parse_keep(getattr(args, s), f"--{s}") for s in ("succeeded", "failed", "cancelled")
    }
    with task_client(args) as client:
        if args.name is not None and args.clear:
            found = client.clear_retention(args.name)
            said = f"retention of {args.name} removed" if found else f"{args.name} had none"
            out.print(said, markup=False)
            return 0
        if args.name is not None and any(v is not None for v in values.values()):
            client.set_retention(
                args.name,
                succeeded_ms=values["succeeded"],
                failed_ms=values["failed"],
                cancelled_ms=values["cancelled"],
            )
        elif args.name is not None or args.clear:
            raise UsageError("give NAME with --succeeded, --failed, --cancelled or --clear")
        docs = client.retention()
    if args.json:
        print_json(docs)
        return 0
    for doc in docs:
        shown = (f"{s} {_shown(doc.get(f'{s}_ms'))}" for s in values)
        out.print(f"{doc['_id']}: {', '.join(shown)}", markup=False)
    out.print(_built_in(bool(docs)), markup=False)
    return 0


def _built_in(any_set: bool) -> str:
    """The line under the table: the built-in defaults, which apply where nothing is set."""
    from mtask.vocabulary import DEFAULT_KEEP_MS

    kept = ", ".join(f"{s} {_shown(ms)}" for s, ms in DEFAULT_KEEP_MS.items())
    head = "elsewhere" if any_set else "no retention set: every name keeps"
    return f"{head} the built-in defaults: {kept}; invalid ones until purged"


def _shown(ms: Any) -> str:
    """A retention as it is written: ``7d``, ``12h``, ``90m``, ``45s``, ``forever``, ``-``."""
    if ms is None:
        return "-"
    if ms == _forever():
        return "forever"
    seconds = int(ms) // 1000
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds // size}{unit}"
    return f"{seconds}s" if int(ms) % 1000 == 0 else f"{int(ms)}ms"
