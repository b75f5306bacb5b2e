"""``mtask top``: a live view of counts, rates and workers (rich's ``Live``; the ``cli``
extra)."""

from __future__ import annotations

import argparse
import datetime as dt
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from mtask.cli.common import (
    Commands,
    add_common,
    add_row,
    fitting_table,
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

    previous: tuple[float, dt.datetime] | None = None
    while True:
        counts = client.state_counts()
        workers = client.workers()
        now, server_now = time.monotonic(), client.now()
        # rates from the finished index (what finished since the last frame), not from the
        # counts: those are estimates on a large collection
        finished = client.finished_since(previous[1]) if previous is not None else {}
        took = None if previous is None else max(1e-3, now - previous[0])
        previous = (now, server_now)
        yield Group(_counts(counts, finished, took, when(server_now)), _crew(workers))
        time.sleep(interval)


def _counts(counts: Any, finished: dict[str, int], took: float | None, at: str) -> Any:
    """Counts per name and derived state (``render.state_table``, as ``mtask stats``), and
    finished per second: readable at 80 columns."""
    from mtask.cli.render import state_table

    rates = {n: "" if took is None else f"{finished.get(n, 0) / took:.1f}" for n in counts.counts}
    table = state_table(counts, title=f"mtask top · {at}", rates=rates)
    if not counts.counts:
        table.caption = "no tasks yet"
    return table


def _crew(workers: list[dict[str, Any]]) -> Any:
    from mtask.explain.wording import plural

    crew = fitting_table(
        "worker", "state", "in flight", "running", fold=("running",), left=("state",),
        title=plural(len(workers), "worker"),
    )  # fmt: skip
    for w in workers:  # models.read_worker: every field in its shape, or its default
        running = ", ".join(r["key"] for r in w["running"][:5])
        add_row(crew, w["_id"], str(w["state"]), f"{w['in_flight']}/{w['concurrency']}", running)
    return crew


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
