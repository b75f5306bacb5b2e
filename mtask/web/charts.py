"""Inline SVG geometry for the dashboard: per-name throughput charts with axes, and a task's
run timeline. Pure functions of the data (the templates draw them)."""

from __future__ import annotations

import datetime as dt
from typing import Any

from mtask.models import Task

WIDTH, HEIGHT = 600, 150
LEFT, BOTTOM, TOP, RIGHT = 40, 22, 8, 8
MAX_CHARTS = 8


def _x(minute: dt.datetime, start: dt.datetime, span: float) -> float:
    return LEFT + (minute - start).total_seconds() / span * (WIDTH - LEFT - RIGHT)


def charts(rows: list[dict[str, Any]], now: dt.datetime, minutes: int = 60) -> list[dict[str, Any]]:
    """One chart per name (the busiest ``MAX_CHARTS``): finished and failed tasks per minute
    over the last ``minutes`` minutes, each a polyline, with the axes' ticks and labels."""
    end = now.replace(second=0, microsecond=0)
    start = end - dt.timedelta(minutes=minutes)
    span = (end - start).total_seconds()
    by_name: dict[str, dict[dt.datetime, tuple[int, int]]] = {}
    for row in rows:
        minute = row["minute"]
        if minute.tzinfo is None:
            minute = minute.replace(tzinfo=dt.UTC)
        by_name.setdefault(str(row["name"]), {})[minute] = (row["finished"], row["failed"])
    busiest = sorted(by_name, key=lambda n: -sum(f for f, _ in by_name[n].values()))
    out = []
    for name in sorted(busiest[:MAX_CHARTS]):
        series = by_name[name]
        peak = max(max(f for f, _ in series.values()), 1)
        minutes_axis = [start + dt.timedelta(minutes=i) for i in range(minutes + 1)]
        scale = (HEIGHT - BOTTOM - TOP) / peak
        lines = [
            " ".join(
                f"{_x(m, start, span):.1f},{HEIGHT - BOTTOM - series.get(m, (0, 0))[i] * scale:.1f}"
                for m in minutes_axis
            )
            for i in (0, 1)
        ]
        out.append(
            {
                "name": name,
                "finished": lines[0],
                "failed": lines[1],
                "peak": peak,
                "total": sum(f for f, _ in series.values()),
                "failed_total": sum(f for _, f in series.values()),
                "ticks": [
                    {"x": _x(m, start, span), "label": m.strftime("%H:%M")}
                    for m in minutes_axis[:: max(1, minutes // 4)]
                ],
            }
        )
    return out


def timeline(task: Task, now: dt.datetime) -> dict[str, Any]:
    """Each run as a bar from its claim to its end (or to now while it runs), on one time axis
    from the task's creation."""
    start = task.created_at or min([r.claimed_at for r in task.runs], default=now)
    ends = [r.finished_at or now for r in task.runs] + [task.finished_at or start]
    end = max([*ends, start + dt.timedelta(seconds=1)])
    span = (end - start).total_seconds()
    width = WIDTH - LEFT - RIGHT
    bars = []
    for index, run in enumerate(task.runs):
        x0 = LEFT + (run.claimed_at - start).total_seconds() / span * width
        x1 = LEFT + ((run.finished_at or now) - start).total_seconds() / span * width
        bars.append(
            {
                "x": round(x0, 1),
                "w": round(max(2.0, x1 - x0), 1),
                "y": 6 + index * 18,
                "state": run.state.value,
                "label": f"{run.worker_id} {run.state.value}",
            }
        )
    return {
        "bars": bars,
        "height": 18 * len(bars) + 34,
        "start": start,
        "end": end,
        "width": WIDTH,
    }
