"""``mtask step`` (also ``mtask steps``): a task's durable steps changed from outside
(docs/steps.md), and the preflight of changed handlers.

- ``mtask step reset KEY STEP``: STEP and every step after it are removed from the task's
  journal, so the next run calls them again; a wait removed this way takes the next signal of
  its name (the one it had taken is removed with it). ``--json``: ``{"key", "step",
  "removed", "signals", "woke"}``.
- ``mtask step rename KEY STEP NEW``: the recorded step STEP is named NEW (a changed handler
  replays it under its new name). ``mtask step drop KEY STEP``: STEP is removed from the
  journal and the later ones move up (a changed handler no longer asks for it); a pending task
  that waited in it runs now. ``--json``: ``{"key", "step", "to", "index", "woke"}``.
- ``mtask step check app:registry [--name NAME]``: every parked task (pending, with steps) of
  the registry's names replayed dry against its handlers, writing nothing: per name, how many
  replay cleanly, mismatch (and at which step), fail otherwise, or could not be checked; exit 1
  if any would mismatch.

Each change is one update, fenced: refused while a run of the task is RUNNING. Exit 2 for no
such step or a bad name; 1 for no such task, or one running or succeeded.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from mtask.cli.common import (
    EXIT_FAILED,
    Commands,
    add_common,
    add_row,
    out,
    print_json,
    task_client,
)

commands = Commands()
run = commands.run


@commands.command("step")
@commands.command("steps")
def cmd_step(args: argparse.Namespace) -> int:
    if args.action == "check":
        return _check(args)
    if args.action == "reset":
        return _reset(args)
    with task_client(args) as client:
        if args.action == "rename":
            done = client.rename_step(args.key, args.step, args.to)
        else:
            done = client.drop_step(args.key, args.step)
    if args.json:
        print_json(dataclasses.asdict(done))
        return 0
    what = f"renamed {done.step} to {done.to}" if done.to else f"dropped {done.step}"
    out.print(f"{what}: {done.key} (step {done.index + 1})", markup=False)
    if done.woke:
        out.print("  it waited there: it runs again now", markup=False)
    return 0


def _reset(args: argparse.Namespace) -> int:
    with task_client(args) as client:
        done = client.reset_step(args.key, args.step)
    if args.json:
        print_json(dataclasses.asdict(done))
        return 0
    out.print(reset_said(done), markup=False)
    return 0


def reset_said(done: Any) -> str:
    """What ``mtask step reset`` did, in whole sentences, and what to do next: a failed or
    cancelled task runs again only once retried (and a signal is taken only then)."""
    from mtask.explain.wording import plural

    removed = plural(len(done.removed), "step")
    said = f"reset: {done.key}: removed {removed} ({', '.join(done.removed)})"
    if done.signals:
        taken = plural(done.signals, "signal")
        said += f" and the {taken} its waits had taken: each wait takes the next one sent"
    if done.woke:
        return f"{said}. It runs again now, from {done.step}."
    if done.status in ("failed", "cancelled"):
        return (
            f"{said}. It is {done.status}: `mtask retry {done.key}` runs it again from "
            f"{done.step}; a signal sent before that is refused."
        )
    return f"{said}. Its next run calls {done.step} again."


def _check(args: argparse.Namespace) -> int:
    from mtask.errors import RegistryNotFound, UsageError
    from mtask.steps.preflight import check

    with task_client(args) as client:
        try:
            report = check(client, args.registry, args.name or None, timeout=args.timeout)
        except RegistryNotFound as exc:  # a bad REGISTRY argument: the command line's mistake
            raise UsageError(str(exc)) from None
    if args.json:
        print_json(report.to_document())
        return EXIT_FAILED if report.bad else 0
    _print_report(report)
    return EXIT_FAILED if report.bad else 0


def _print_report(report: Any) -> None:
    from rich.table import Table

    table = Table("name", "parked", "clean", "mismatch", "error", "unchecked", "orphaned")
    for name, named in sorted(report.names.items()):
        c = named.counts
        kinds = ("clean", "mismatch", "error", "unchecked", "orphaned")
        cells = (named.parked, *(c[k] for k in kinds))
        add_row(table, name, *(str(n) for n in cells))
    out.print(table)
    for named in report.names.values():
        for verdict in named.examples:
            place = f" at step {verdict.step}" if verdict.step else ""
            out.print(f"{verdict.outcome}: {verdict.key}{place}: {verdict.detail}", markup=False)
    parked = sum(n.parked for n in report.names.values())
    out.print(f"{parked} parked task(s) checked in {report.seconds:.1f} s; nothing written")


def register(sub: Any) -> None:
    p = sub.add_parser(
        "step",
        aliases=["steps"],
        help="a task's durable steps: reset, rename, drop; check changed handlers",
    )
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    q = actions.add_parser("reset", help="redo a task's durable steps from STEP")
    add_common(q)
    q.add_argument("key")
    q.add_argument("step", help="the recorded step's name (wait:approved, charge, sleep#1)")
    q = actions.add_parser("rename", help="rename a parked task's recorded step")
    add_common(q)
    q.add_argument("key")
    q.add_argument("step", help="the recorded step's name")
    q.add_argument("to", help="its new name")
    q = actions.add_parser("drop", help="drop a recorded step from a parked task's journal")
    add_common(q)
    q.add_argument("key")
    q.add_argument("step", help="the recorded step's name")
    q = actions.add_parser(
        "check", help="replay every parked task dry against new handlers (writes nothing)"
    )
    add_common(q)
    q.add_argument("registry", help="module:attribute of the new mtask.Registry")
    q.add_argument("--name", action="append", help="only tasks of this name (repeat for more)")
    q.add_argument(
        "--timeout",
        type=float,
        default=5.0,
        help="seconds one task's replay may take before it is reported unchecked (5)",
    )
