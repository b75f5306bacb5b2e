"""``mtask logs KEY [--follow] [--after SEQ] [--kind log|chunk] [--json | --raw]``: a task's
log lines and output chunks (docs/output.md).

Without ``--follow`` it prints what is stored and exits; with it, it goes on printing new
entries as the task's runs write them and exits once the task is finished. ``--after SEQ``
starts after that entry: the last ``seq`` printed (``--json`` prints it on every line) resumes
exactly where an earlier call stopped. ``--raw`` writes chunks as they are (text as is, bytes
decoded as UTF-8), without a newline between them, and log lines to stderr: a token stream
reads as text. Exit status: 0; 1 no such task or MongoDB trouble; 2 bad arguments.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING

from mtask.cli.common import Commands, add_common, json_default, out, task_client, when
from mtask.errors import TaskNotFound, UsageError

if TYPE_CHECKING:
    from mtask.streams import Entry

commands = Commands()
run = commands.run


@commands.command("logs")
def cmd_logs(args: argparse.Namespace) -> int:
    if args.json and args.raw:
        raise UsageError("--json and --raw do not go together: choose one")
    kinds = None if args.kind is None else [args.kind]
    with task_client(args) as client:
        if args.follow:
            show(client.stream(args.key, after=args.after, kinds=kinds), args)
            return 0
        if client.get(args.key) is None:
            raise TaskNotFound(args.key)
        after = args.after
        while True:  # every stored entry, a page at a time
            page = client.output(args.key, after=after, kinds=kinds)
            show(page, args)
            if len(page) < 1000:
                return 0
            after = page[-1].seq


def show(entries: Iterable[Entry], args: argparse.Namespace) -> None:
    for entry in entries:
        if args.json:
            sys.stdout.write(json.dumps(entry.to_json(), default=json_default) + "\n")
        elif args.raw:
            target = sys.stdout if entry.kind == "chunk" else sys.stderr
            target.write(entry.text() if entry.kind == "chunk" else entry.text() + "\n")
        else:
            tag = entry.kind if entry.kind == "chunk" else (entry.level or "log")
            text = entry.text().rstrip("\n")
            out.print(f"{entry.seq:>6} {when(entry.at)} {tag:<7} {text}", markup=False)
        sys.stdout.flush()


MAX_SEQ = 2**63 - 1
"""The largest ``seq`` a query can hold (a BSON int64)."""


def _seq(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a sequence number: {text!r}") from None
    if not 0 <= value <= MAX_SEQ:
        raise argparse.ArgumentTypeError(f"must be 0 to {MAX_SEQ}: {text!r}")
    return value


def register(sub: object) -> None:
    p = sub.add_parser(  # type: ignore[attr-defined]
        "logs", help="a task's log lines and output chunks (--follow: until it is finished)"
    )
    add_common(p)
    p.add_argument("key")
    p.add_argument("-f", "--follow", action="store_true", help="follow until the task finishes")
    p.add_argument("--after", type=_seq, default=0, metavar="SEQ", help="start after this entry")
    p.add_argument("--kind", choices=["log", "chunk"], help="only log lines, or only chunks")
    p.add_argument("--raw", action="store_true", help="chunks as they are, logs to stderr")
