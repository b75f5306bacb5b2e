"""Bench WL, a changed limit: how long after ``set_limit`` runs still start under
the old limit, and how long until every worker says it applies the new one.

Three worker processes (concurrency 4, no prefetch) run ``span`` tasks of 200 ms (each returns
its handler's own start and end, ``time.time()`` on this host) on a mongod of the bench's own,
with the workers' default periodic read of the limits (5 s with an own stream, 30 s with the
shared one: the change must apply on its event). While runs are in flight the limit is lowered:

- ``group``: ``group_concurrency`` 3 -> 1 over 3 groups (the issue's case: each group kept
  running 3 at once for 18-24 s);
- ``name``: ``concurrency`` 4 -> 1.

Per kind and stream: the time from just before ``set_limit`` to the last run started beside
more runs (of its group, or of the name) than the new limit allows — 0 if none did (runs in
flight at the change finish, and count towards the new limit) — and the time until the last
worker logged ``limits_applied`` (its log's clock is this host's). Median and worst of the
rounds. Target: both within a second.
"""

from __future__ import annotations

import datetime as dt
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.support import LOOP, QUICK, ROOT, Result, stop_process, wait_until
from mtask.client import TaskClient
from mtask.testing import worker_argv

if TYPE_CHECKING:
    from bench.workloads import Bench

WORKERS = 3
TASK_MS = 200
KINDS: dict[str, tuple[dict[str, Any], dict[str, Any], int | None]] = {
    # old limit, new limit, groups
    "group": ({"group_concurrency": 3}, {"group_concurrency": 1}, 3),
    "name": ({"concurrency": 4}, {"concurrency": 1}, None),
}
APPLIED = "limits_applied name=span"


def _spawn(uri: str, database: str, stream: str, log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(
            worker_argv(
                "bench.app:registry",
                uri,
                database,
                *("--loop", LOOP, "--concurrency", "4", "--prefetch", "0", "--stream", stream),
                *("--log-level", "INFO"),  # its limits_applied lines
            ),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )


def _applied_at(log: Path) -> list[float]:
    """When (this host's clock) the worker logged each ``limits_applied`` of ``span``."""
    out = []
    for line in log.read_text(errors="replace").splitlines():
        if APPLIED in line:
            stamp = dt.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
            out.append(stamp.timestamp())
    return out


def _late_start(spans: list[tuple[float, float, str]], changed: float, limit: int) -> float:
    """Seconds from ``changed`` to the last run started beside more runs of its scope than
    ``limit`` (0 if none)."""
    late = 0.0
    for start, _, scope in spans:
        if start <= changed:
            continue
        crowd = sum(1 for s, e, g in spans if g == scope and s <= start < e)
        if crowd > limit:
            late = max(late, start - changed)
    return late


def _one(uri: str, kind: str, stream: str, round_: int, tmp: Path) -> dict[str, float]:
    old, new, groups = KINDS[kind]
    database = f"wl_{kind}_{stream}_{round_}"
    logs = [tmp / f"{database}-{i}.log" for i in range(WORKERS)]
    with TaskClient(uri, database=database) as client:
        client.set_limit("span", **old)
        procs = [_spawn(uri, database, stream, log) for log in logs]
        try:
            wait_until(lambda: all(_applied_at(log) for log in logs), timeout=60)
            tasks = 36
            client.publish_many(
                [
                    {
                        "name": "span",
                        "key": f"t{i:03d}",
                        "params": {"ms": TASK_MS},
                        **({} if groups is None else {"options": {"group": f"g{i % groups}"}}),
                    }
                    for i in range(tasks)
                ]
            )
            running = {"name": "span", "status": "running"}
            wait_until(lambda: client.collection.count_documents(running) >= 3, timeout=60)
            changed = time.time()
            client.set_limit("span", **new)
            done = {"name": "span", "status": "succeeded"}
            wait_until(lambda: client.collection.count_documents(done) == tasks, timeout=120)
            spans = [
                (d["result"][0], d["result"][1], d.get("options", {}).get("group", ""))
                for d in client.collection.find({"name": "span"}, {"result": 1, "options": 1})
            ]
        finally:
            for proc in procs:
                stop_process(proc)
        limit = next(iter(new.values()))
        acks = [max(_applied_at(log)) for log in logs]
        return {"late_s": _late_start(spans, changed, limit), "applied_s": max(acks) - changed}


def limit_changes(bench: Bench) -> None:
    from bench.scale import _own_mongod

    rounds = 1 if bench.sizes is QUICK else 3
    streams = os.environ.get("MTASK_WL_STREAMS", "own,shared").split(",")
    figures: dict[tuple[str, str], list[dict[str, float]]] = {}
    with (
        _own_mongod() as (uri, _pid, _port),
        tempfile.TemporaryDirectory(prefix="mtask-wl-") as tmp,
    ):
        for r in range(rounds):
            for kind in KINDS:
                for stream in streams:
                    figures.setdefault((kind, stream), []).append(
                        _one(uri, kind, stream, r, Path(tmp))
                    )
    for (kind, stream), rows in figures.items():
        late = [row["late_s"] for row in rows]
        applied = [row["applied_s"] for row in rows]
        old, new, _ = KINDS[kind]
        (field, before), (_, after) = next(iter(old.items())), next(iter(new.items()))
        bench.record(
            Result(
                f"WL {kind} limit lowered ({stream} streams)",
                f"last run under the old limit {statistics.median(late) * 1000:.0f} ms after "
                f"set_limit (worst {max(late) * 1000:.0f}); every worker applied it within "
                f"{statistics.median(applied) * 1000:.0f} ms (worst {max(applied) * 1000:.0f})",
                "both ≤ 1 s",
                max(late) <= 1.0 and max(applied) <= 1.0,
                f"{field} {before} -> {after}; {WORKERS} worker processes x concurrency 4, "
                f"{TASK_MS} ms tasks, default periodic read, {len(rows)} round(s)",
                {
                    "late_ms": statistics.median(late) * 1000,
                    "late_worst_ms": max(late) * 1000,
                    "applied_ms": statistics.median(applied) * 1000,
                    "applied_worst_ms": max(applied) * 1000,
                },
            )
        )
