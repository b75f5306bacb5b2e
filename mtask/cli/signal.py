"""``mtask signal KEY NAME [--payload JSON]``: send a signal to an open task (docs/steps.md).

The handler's ``ctx.wait_for(NAME)`` returns the payload, whether its wait began before or after.
Prints whether the signal woke the task (it was waiting for NAME) or was kept for a later wait;
``--json`` prints ``{"key", "signal", "woke"}``. Exit 2 for a bad name or payload (not JSON, not
BSON-able, over 64 KiB); 1 for no such task, a finished one, or one holding 1,000 signals.
"""

from __future__ import annotations

import argparse
from typing import Any

from mtask.cli.common import Commands, add_common, err, out, parse_json, print_json, task_client

commands = Commands()
run = commands.run


def parse_payload(text: str | None) -> Any:
    if text is None:
        return None
    return parse_json(text, "--payload")


@commands.command("signal")
def cmd_signal(args: argparse.Namespace) -> int:
    from mtask.steps.signal_fate import NEXT_WAIT, fate

    payload = parse_payload(args.payload)
    with task_client(args) as client:
        woke = client.signal(args.key, args.name, payload)
        task = None if woke or args.json else client.get(args.key)
    if args.payload is None and not args.json:  # said once the signal is sent: a task's
        err.print(  # absence is its own error, alone
            "mtask: warning: no --payload: the wait returns None to its handler (on every retry "
            "too); a handler that reads fields of it fails",
            markup=False,
        )
    if args.json:
        print_json({"key": args.key, "signal": args.name, "woke": woke})
    elif woke:
        out.print(
            f"signalled: {args.key} ({args.name}): it was waiting, it runs again now", markup=False
        )
    else:
        said = NEXT_WAIT if task is None else fate(task, args.name, woke)
        if said == NEXT_WAIT:  # the first wait_for of the name takes it
            said = f"kept for its wait_for({args.name!r})"
        out.print(f"signalled: {args.key} ({args.name}): {said}", markup=False)
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser("signal", help="send a signal to a task (its ctx.wait_for returns it)")
    add_common(p)
    p.add_argument("key", help="the task's key")
    p.add_argument("name", help="the signal's name")
    p.add_argument("--payload", metavar="JSON", help="a JSON value, handed to the waiting handler")
