"""``mtask logs KEY [--follow] [--after SEQ] [--kind log|chunk] [--json | --raw]``: a task's
log lines and output chunks (docs/output.md).

Without ``--follow`` it prints what is stored and exits; with it, it goes on printing new
entries as the task's runs write them and exits once the task is finished. ``--after SEQ``
starts after that entry: the last ``seq`` printed (``--json`` prints it on every line) resumes
exactly where an earlier call stopped. ``--raw`` writes chunks as they are (text as is, bytes
decoded as UTF-8), without a newline between them, and log lines to stderr: a token stream
reads as text. While following, stderr says where the task is whenever that changes (running,
sleeping until …, waiting for a signal, waiting on the tasks it depends on, to run again after
a failure) and, at the end, how it ended. Exit status: 0; 1 no such task or MongoDB trouble; 2
bad arguments.
"""

from __future__ import annotations

import argparse
import json
import queue
import sys
import threading
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from mtask.cli.common import Commands, add_common, err, json_default, out, task_client, when
from mtask.errors import TaskNotFound, UsageError

if TYPE_CHECKING:
    from mtask.client import TaskClient
    from mtask.follow.streams import Entry
    from mtask.models import Task

commands = Commands()
run = commands.run


@commands.command("logs")
def cmd_logs(args: argparse.Namespace) -> int:
    if args.json and args.raw:
        raise UsageError("--json and --raw do not go together: choose one")
    kinds = None if args.kind is None else [args.kind]
    with task_client(args) as client:
        if args.follow:
            follow(client, args, kinds)
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


IDLE_CHECK = 1.0
"""Seconds without a new entry after which ``follow`` reads the task's state again (one read
by key): a run that sleeps or waits writes nothing more, and its status change brings no
entry."""
_END = object()


def follow(client: TaskClient, args: argparse.Namespace, kinds: list[str] | None) -> None:
    """The entries as they come, with a line on stderr each time the task's state changes
    (``where``) and one saying how it ended."""
    task = client.get(args.key)
    if task is None:
        raise TaskNotFound(args.key)
    said = _say(where(task), None)
    entries: queue.Queue[Any] = queue.Queue()
    stream = client.stream(args.key, after=args.after, kinds=kinds)
    threading.Thread(target=_pump, args=(stream, entries), daemon=True).start()
    while True:
        try:
            item = entries.get(timeout=IDLE_CHECK)
        except queue.Empty:
            now = client.get(args.key)
            said = _say(where(now) if now is not None else None, said)
            continue
        if item is _END:
            break
        if isinstance(item, BaseException):
            raise item
        show([item], args)
    final = client.get(args.key)
    _say(where(final) if final is not None else f"{args.key} was removed", said)


def _pump(stream: Iterator[Entry], into: queue.Queue[Any]) -> None:
    """The stream's entries into ``into`` (on a thread of its own: it blocks while the task
    says nothing), then ``_END``, or the exception that ended it."""
    try:
        for entry in stream:
            into.put(entry)
    except BaseException as exc:  # noqa: BLE001 - handed to the reader, which raises it
        into.put(exc)
    else:
        into.put(_END)


def _say(note: str | None, said: str | None) -> str | None:
    if note is not None and note != said:
        err.print(f"mtask: {note}", markup=False)
        return note
    return said


def where(task: Task) -> str:
    """Where the task is, in one line: what ``logs --follow`` says when it changes."""
    from mtask.steps import NEVER

    key = task.key
    status = task.status.value if task.status is not None else "pending"
    if status == "running":
        return f"{key} is running (run {task.attempts or 1})"
    if status != "pending":
        return f"{key} {_ended(task, status)}"
    w = task.waiting
    if w is not None:
        step = f"step {w.index + 1}" + (f": {w.step}" if w.step else "")
        if w.signal is not None:
            until = "no deadline" if w.until.year >= NEVER.year else f"until {when(w.until)}"
            return f"{key} is waiting for the signal {w.signal!r} ({step}), {until}"
        return f"{key} is sleeping until {when(w.until)} ({step})"
    if task.waiting_on:
        return f"{key} is waiting on {', '.join(task.waiting_on)}"
    if task.attempts:
        failed = _last_line(task.error)
        why = f" (run {task.attempts} failed: {failed})" if failed else ""
        return f"{key} runs again at {when(task.next_claim_at)}{why}"
    return f"{key} is pending: not claimed yet (due at {when(task.next_claim_at)})"


def _ended(task: Task, status: str) -> str:
    runs = task.attempts or 0
    after = f" after {runs} runs" if runs > 1 else ""
    if status == "succeeded":
        return f"succeeded{after}"
    if status == "failed":
        return f"failed{after}: {_last_line(task.error) or 'no error was recorded'}"
    if status == "invalid":
        return f"is invalid: {task.invalid_reason or '-'}"
    return status


def _last_line(text: str | None) -> str:
    lines = (text or "").strip().splitlines()
    return lines[-1].strip() if lines else ""


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
    p.add_argument("key", help="the task's key")
    p.add_argument("-f", "--follow", action="store_true", help="follow until the task finishes")
    p.add_argument("--after", type=_seq, default=0, metavar="SEQ", help="start after this entry")
    p.add_argument("--kind", choices=["log", "chunk"], help="only log lines, or only chunks")
    p.add_argument("--raw", action="store_true", help="chunks as they are, logs to stderr")
