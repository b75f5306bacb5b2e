"""``mtask top`` (a live view) and ``mtask publish --from-file`` (JSON lines, with progress)."""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections.abc import Iterator
from typing import IO, Any

from rich.console import Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from mtask.cli import UsageError, _common, _task_client, _when, command, out, print_json
from mtask.client import build_many
from mtask.errors import InvalidTask
from mtask.models import TaskStatus

BATCH = 1000


def read_lines(stream: IO[str], source: str) -> tuple[list[dict[str, Any]], list[int]]:
    """Every line a JSON object (blank lines skipped), and the line number of each; an error
    names the line."""
    items = []
    lines = []
    for number, line in enumerate(stream, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UsageError(f"{source}:{number}: not valid JSON: {exc.msg}") from None
        if not isinstance(item, dict):
            raise UsageError(f"{source}:{number}: must be a JSON object")
        items.append(item)
        lines.append(number)
    return items, lines


def publish_from_file(args: argparse.Namespace) -> int:
    """Validate every line first (nothing is written if one is bad), then publish in batches
    with a progress bar."""
    source = "stdin" if args.from_file == "-" else args.from_file
    try:
        if args.from_file == "-":
            items, lines = read_lines(sys.stdin, source)
        else:
            with open(args.from_file, encoding="utf-8") as stream:
                items, lines = read_lines(stream, source)
    except OSError as exc:
        raise UsageError(f"cannot read {source}: {exc.strerror}") from None
    with _task_client(args) as client:
        now = client.now()
        try:
            build_many(items, now, client.max_params_bytes)
        except InvalidTask as exc:  # "items[3].key: …" -> "file:5: key: …"
            found = re.match(r"items\[(\d+)\]\.?(.*)", exc.message, flags=re.S)
            where = f"{source}:{lines[int(found[1])]}" if found else source
            raise InvalidTask(f"{where}: {found[2] if found else exc.message}") from None
        created = 0
        progress = Progress(
            TextColumn("publishing"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            console=out, disable=args.json or not out.is_terminal,
        )  # fmt: skip
        with progress:
            bar = progress.add_task("publish", total=len(items))
            for start in range(0, len(items), BATCH):
                chunk = items[start : start + BATCH]
                created += client.publish_many(chunk)
                progress.advance(bar, len(chunk))
    if args.json:
        print_json({"created": created, "given": len(items)})
    else:
        out.print(f"published {len(items)} tasks from {source}: {created} created")
    return 0


def _frames(client: Any, interval: float) -> Iterator[Group]:
    previous: tuple[float, dict[str, int]] | None = None
    statuses = [s.value for s in TaskStatus]
    while True:
        counts = client.stats()
        workers = client.workers()
        now = time.monotonic()
        finished = {n: c.get("succeeded", 0) + c.get("failed", 0) for n, c in counts.items()}
        table = Table("name", *statuses, "finished/s", title=f"mtask top · {_when(client.now())}")
        for name in sorted(counts):
            rate = ""
            if previous is not None:
                took = max(1e-3, now - previous[0])
                rate = f"{(finished[name] - previous[1].get(name, 0)) / took:.1f}"
            table.add_row(name, *(str(counts[name].get(s, 0)) for s in statuses), rate)
        crew = Table("worker", "state", "in flight", "running", title=f"{len(workers)} worker(s)")
        for w in workers:
            running = ", ".join(r["key"] for r in (w.get("running") or [])[:5])
            crew.add_row(
                w["_id"],
                str(w.get("state")),
                f"{w.get('in_flight')}/{w.get('concurrency')}",
                running,
            )
        previous = (now, finished)
        yield Group(table, crew)
        time.sleep(interval)


@command("top")
def cmd_top(args: argparse.Namespace) -> int:
    """Counts, rates and workers, refreshed every ``--interval`` seconds until Ctrl-C."""
    with _task_client(args) as client:
        frames = _frames(client, args.interval)
        first = next(frames)
        if args.iterations == 1 or not out.is_terminal:
            out.print(first)
            for _ in range(args.iterations - 1):
                out.print(next(frames))
            return 0
        with Live(first, console=out, screen=False, auto_refresh=False) as live:
            shown = 1
            while args.iterations == 0 or shown < args.iterations:
                live.update(next(frames), refresh=True)
                shown += 1
    return 0


def add_parsers(sub: Any) -> None:
    p = sub.add_parser("top", help="a live view of counts, rates and workers")
    _common(p)
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    p.add_argument("--iterations", type=int, default=0, help="stop after N frames (0: never)")
