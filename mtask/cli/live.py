"""``mtask top``: a live view of counts, rates and workers (rich's ``Live``; the ``cli``
extra)."""

from __future__ import annotations

import argparse
import datetime as dt
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from mtask.cli.common import (
    STATUSES,
    Commands,
    add_common,
    add_row,
    out,
    require,
    task_client,
    when,
)

if TYPE_CHECKING:
    from rich.console import Group

commands = Commands()
run = commands.run


def _frames(client: Any, interval: float) -> Iterator[Group]:
    from rich.console import Group
    from rich.table import Table

    previous: tuple[float, dt.datetime] | None = None
    statuses = list(STATUSES)
    while True:
        counts = client.stats()
        workers = client.workers()
        now, server_now = time.monotonic(), client.now()
        # rates from the finished index (what finished since the last frame), not from the
        # counts: those are estimates on a large collection
        finished = client.finished_since(previous[1]) if previous is not None else {}
        table = Table("name", *statuses, "finished/s", title=f"mtask top · {when(server_now)}")
        if counts.at_least:
            table.caption = f"{counts.exact_up_to:,}+: more than that many"
        for name in sorted(counts):
            rate = ""
            if previous is not None:
                took = max(1e-3, now - previous[0])
                rate = f"{finished.get(name, 0) / took:.1f}"
            cells = [counts.show(name, s) for s in statuses]
            add_row(table, name, *cells, rate)
        crew = Table("worker", "state", "in flight", "running", title=f"{len(workers)} worker(s)")
        for w in workers:  # models.read_worker: every field in its shape, or its default
            running = ", ".join(r["key"] for r in w["running"][:5])
            add_row(
                crew,
                w["_id"],
                str(w["state"]),
                f"{w['in_flight']}/{w['concurrency']}",
                running,
            )
        previous = (now, server_now)
        yield Group(table, crew)
        time.sleep(interval)


@commands.command("top")
def cmd_top(args: argparse.Namespace) -> int:
    """Counts, rates and workers, refreshed every ``--interval`` seconds until Ctrl-C."""
    require("mtask top", "rich")
    with task_client(args) as client:
        frames = _frames(client, args.interval)
        first = next(frames)
        if args.iterations == 1 or not out.is_terminal:
            out.print(first)
            for _ in range(args.iterations - 1):
                out.print(next(frames))
            return 0
        from rich.live import Live

        with Live(first, console=out.console, screen=False, auto_refresh=False) as live:
            shown = 1
            while args.iterations == 0 or shown < args.iterations:
                live.update(next(frames), refresh=True)
                shown += 1
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser("top", help="a live view of counts, rates and workers")
    add_common(p)
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    p.add_argument("--iterations", type=int, default=0, help="stop after N frames (0: never)")
