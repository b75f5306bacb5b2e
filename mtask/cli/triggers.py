"""``mtask triggers``: the triggers and the collections tasks wait on (docs/triggers.md), each
with who follows it, its lag and its counts; ``pause``, ``resume`` and ``reset`` one."""

from __future__ import annotations

import argparse
import datetime as dt
from typing import Any

from mtask.cli.common import Commands, add_common, add_row, out, print_json, task_client, when
from mtask.errors import UsageError

commands = Commands()
run = commands.run


def state_text(doc: dict[str, Any]) -> str:
    if doc.get("paused"):
        return "paused"
    scan = doc.get("scan")
    if doc.get("held") and isinstance(scan, dict) and not scan.get("done"):
        return f"scanning ({scan.get('published', 0)} so far)"
    return "following" if doc.get("held") else "not held"


def label_of(doc: dict[str, Any]) -> str:
    from mtask.triggers import follower_label  # the parser loads no model

    return follower_label(doc.get("kind"), doc.get("name"))


@commands.command("triggers")
def cmd_triggers(args: argparse.Namespace) -> int:
    with task_client(args) as client:
        if args.action == "list":
            if args.name is not None:
                raise UsageError("mtask triggers list takes no name")
            docs = client.triggers()
            if args.json:
                print_json(docs)
            else:
                _print(docs)
            return 0
        if args.name is None:
            raise UsageError(f"mtask triggers {args.action} needs the trigger's name")
        if args.scan and args.action != "reset":
            raise UsageError("--scan goes with reset")
        if args.action == "reset":
            doc = client.reset_trigger(args.name, scan=args.scan)
        elif args.action == "pause":
            doc = client.pause_trigger(args.name)
        else:
            doc = client.resume_trigger(args.name)
    if args.json:
        print_json(doc)
        return 0
    said = {
        "pause": "paused (its holder stops within 3 s; its position is kept)",
        "resume": "resumed (followed again within 5 s, from its position)",
        "reset": "reset: followed from now" + (", after a scan" if args.scan else ""),
    }[args.action]
    out.print(f"{label_of(doc)}: {said}", markup=False)
    return 0


def _date(value: Any) -> dt.datetime | None:
    """A date as stored, or ``None`` for a field in another shape (a hand edit)."""
    return value if isinstance(value, dt.datetime) else None


def _print(docs: list[dict[str, Any]]) -> None:
    if not docs:
        out.print("no triggers (a registry declares them: docs/triggers.md)", markup=False)
        return
    from rich.table import Table

    from mtask.triggers import describe_lag

    table = Table(
        "trigger", "collection", "task", "state", "lag", "last change (UTC)", "published",
        "changes", "history lost", "holder",
    )  # fmt: skip
    for doc in docs:
        spec = doc.get("spec")
        spec = spec if isinstance(spec, dict) else {}
        lost = doc.get("lost") or 0
        add_row(
            table,
            label_of(doc),
            str(doc.get("collection")),
            str(spec.get("task", "-")),
            state_text(doc),
            describe_lag(doc.get("lag_ms")),
            when(_date(doc.get("at"))),
            str(doc.get("published") or 0),
            str(doc.get("changes") or 0),
            f"{lost} (last {when(_date(doc.get('lost_at')))})" if lost else "0",
            str(doc.get("holder") or "-") if doc.get("held") else "-",
        )
    out.print(table)


def register(sub: Any) -> None:
    p = sub.add_parser(
        "triggers",
        help="triggers and waited-on collections: list (lag, counts), pause, resume, reset",
    )
    add_common(p)
    p.add_argument(
        "action",
        nargs="?",
        default="list",
        choices=["list", "pause", "resume", "reset"],
        help="list (the default); pause, resume or reset NAME",
    )
    p.add_argument("name", nargs="?", help="the trigger's name, or wait:COLLECTION")
    p.add_argument(
        "--scan",
        action="store_true",
        help="reset: scan the matching documents first (a task for each, once)",
    )
