"""``mtask step reset KEY STEP``: reset a task's durable steps to before STEP (docs/steps.md).

STEP and every step after it are removed from the task's journal, so the next run calls them
again; a wait removed this way takes the next signal of its name (the one it had taken is
removed with it). One update, fenced: refused while a run of the task is RUNNING. Exit 2 for
no such step; 1 for no such task, or one running or succeeded. ``--json`` prints ``{"key",
"step", "removed", "signals", "woke"}``.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from mtask.cli.common import Commands, add_common, out, print_json, task_client

commands = Commands()
run = commands.run


@commands.command("step")
def cmd_step(args: argparse.Namespace) -> int:
    with task_client(args) as client:
        done = client.reset_step(args.key, args.step)
    if args.json:
        print_json(dataclasses.asdict(done))
        return 0
    steps = ", ".join(done.removed)
    out.print(f"reset: {done.key}: removed {steps}", markup=False)
    if done.signals:
        out.print(
            f"  and the {done.signals} signal(s) their waits had taken: the waits take the next",
            markup=False,
        )
    after = "it runs again now" if done.woke else "its next run calls them again"
    out.print(f"  {after} (mtask retry {done.key} if it failed)", markup=False)
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser("step", help="reset a task's durable steps (redo from a step)")
    add_common(p)
    p.add_argument("action", choices=["reset"])
    p.add_argument("key")
    p.add_argument("step", help="the recorded step's name (wait:approved, charge, sleep#1)")
