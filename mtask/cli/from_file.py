"""``mtask publish --from-file FILE``: JSON lines, every one validated first (nothing is
written if one is bad), then published in batches with a progress bar."""

from __future__ import annotations

import argparse
import re
import sys
from typing import IO, Any

from mtask.cli.common import out, parse_json, print_json, task_client
from mtask.errors import InvalidTask, UsageError

BATCH = 1000


def read_lines(stream: IO[str], source: str) -> tuple[list[dict[str, Any]], list[int]]:
    """Every line a JSON object (blank lines skipped), and the line number of each; an error
    names the line."""
    items = []
    lines = []
    number = 0
    try:
        for number, line in enumerate(stream, 1):
            if not line.strip():
                continue
            item = parse_json(line, f"{source}:{number}")
            if not isinstance(item, dict):
                raise UsageError(f"{source}:{number}: must be a JSON object")
            items.append(item)
            lines.append(number)
    except UnicodeDecodeError as exc:  # raised by the reading, for the lines after ``number``
        raise UsageError(f"{source}: not UTF-8 after line {number}: {exc.reason}") from None
    return items, lines


# The single publish's per-task options, as given on the command line: ``--from-file`` takes
# none of them (each line holds its own params, options, delay and depends_on; its tasks are
# inserted if absent, with no supersede policy and no debounce window).
PER_TASK_OPTIONS = {
    "params": "--params",
    "options": "--options",
    "priority": "--priority",
    "concurrency": "--concurrency",
    "max_retries": "--max-retries",
    "worker_timeout_ms": "--worker-timeout-ms",
    "ping_interval_ms": "--ping-interval-ms",
    "worker": "--worker",
    "delay": "--delay",
    "depends_on": "--depends-on",
    "supersede": "--supersede",
    "debounce": "--debounce",
    "debounce_max": "--debounce-max",
}


def refuse_per_task_options(args: argparse.Namespace) -> None:
    """A per-task option given with ``--from-file`` is refused, not silently ignored (it would
    apply to no line). ``--on-conflict ignore``, the default, is what the file's insert does."""
    given = [flag for attr, flag in PER_TASK_OPTIONS.items() if getattr(args, attr) is not None]
    if args.on_conflict != "ignore":
        given.append(f"--on-conflict {args.on_conflict}")
    if given:
        raise UsageError(
            f"{', '.join(given)} cannot be used with --from-file (each line holds its own "
            "params, options, delay and depends_on; a file's tasks are inserted if absent, "
            "with no supersede policy or debounce)"
        )


def publish_from_file(args: argparse.Namespace) -> int:
    """Validate every line first (nothing is written if one is bad), then publish in batches
    with a progress bar."""
    from mtask.client import build_many

    source = "stdin" if args.from_file == "-" else args.from_file
    try:
        if args.from_file == "-":
            items, lines = read_lines(sys.stdin, source)
        else:
            with open(args.from_file, encoding="utf-8") as stream:
                items, lines = read_lines(stream, source)
    except OSError as exc:
        raise UsageError(f"cannot read {source}: {exc.strerror}") from None
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    with task_client(args) as client:
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
            console=out.console, disable=args.json or not out.is_terminal,
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
        out.print(f"published {len(items)} tasks from {source}: {created} created", markup=False)
    return 0
