"""``mtask demo``: publish a few hundred sample tasks, start three worker processes, kill one
mid-run so its tasks are preempted, show progress live, and end with what ran where.

The handlers here are also a registry you can run yourself:
``mtask-worker mtask.demo:registry``.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal
import subprocess
import time
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from mtask.client import TaskClient
from mtask.registry import Registry, TaskContext
from mtask.testing import worker_argv

registry = Registry()


@registry.task("resize")
async def resize(params: dict[str, Any]) -> dict[str, Any]:
    await asyncio.sleep(params.get("ms", 50) / 1000)
    return {"width": params.get("width", 640)}


@registry.task("transcode")
async def transcode(params: dict[str, Any]) -> str:
    await asyncio.sleep(params.get("ms", 1500) / 1000)
    return "done"


@registry.task("flaky")
def flaky(params: dict[str, Any], ctx: TaskContext) -> str:
    if ctx.attempt == 1:
        raise ConnectionError("upstream timed out (fails on the first attempt)")
    return f"ok on attempt {ctx.attempt}"


@registry.task("doomed")
def doomed(params: dict[str, Any]) -> None:
    raise ValueError("this sample task always fails")


DATABASE = "mtask_demo"
WORKERS = 3
FAST = {"worker_timeout_ms": 3000, "ping_interval_ms": 500, "retry_delay_ms": 200}


def sample_tasks(rng: random.Random) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    for i in range(200):
        items.append(
            {
                "name": "resize",
                "key": f"img-{i:03}",
                "params": {"ms": rng.randint(20, 200), "width": rng.choice([320, 640])},
                "options": FAST,
            }
        )
    for i in range(60):
        items.append(
            {
                "name": "transcode",
                "key": f"video-{i:02}",
                "params": {"ms": rng.randint(800, 2000)},
                "options": FAST,
            }
        )
    for i in range(39):
        items.append({"name": "flaky", "key": f"flaky-{i:02}", "options": FAST})
    items.append({"name": "doomed", "key": "doomed", "options": {**FAST, "max_retries": 2}})
    return items


def _spawn(uri: str, index: int) -> subprocess.Popen[bytes]:
    options = ["--worker-id", f"worker-{index}", "--concurrency", "16", "--grace", "5"]
    return subprocess.Popen(
        worker_argv("mtask.demo:registry", uri, DATABASE, *options, "--log-level", "ERROR"),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
    )


def _busiest(client: TaskClient) -> int | None:
    """The demo worker (1-based) holding the most running tasks, if any holds some."""
    rows = list(
        client.collection.aggregate(
            [
                {"$match": {"status": "running"}},
                {"$unwind": "$runs"},
                {"$match": {"runs.state": "RUNNING"}},
                {"$group": {"_id": "$runs.worker_id", "n": {"$sum": 1}}},
                {"$sort": {"n": -1}},
                {"$limit": 1},
            ]
        )
    )
    if not rows or not str(rows[0]["_id"]).startswith("worker-"):
        return None
    return int(str(rows[0]["_id"]).removeprefix("worker-"))


def _where(client: TaskClient) -> Table:
    rows = client.collection.aggregate(
        [
            {"$unwind": "$runs"},
            {"$group": {"_id": {"w": "$runs.worker_id", "s": "$runs.state"}, "n": {"$sum": 1}}},
        ]
    )
    table_data: dict[str, dict[str, int]] = {}
    for row in rows:
        table_data.setdefault(row["_id"]["w"], {})[row["_id"]["s"]] = row["n"]
    states = ["SUCCESS", "FAIL", "TIMEOUT", "RELEASED"]
    table = Table("worker", *states, title="What ran where: runs by worker and outcome")
    table.title_justify = "left"
    for worker in sorted(table_data):
        table.add_row(worker, *(str(table_data[worker].get(s, 0)) for s in states))
    return table


def run_demo(uri: str | None = None, seconds: float = 120.0) -> int:
    """Publish the sample tasks to ``DATABASE``, run them on ``WORKERS`` worker processes
    (one killed mid-run), and print what ran where: 0 once every task finished. A terminal
    sees a live progress bar; a pipe one line when they finished."""
    console = Console()
    client = TaskClient(uri, database=DATABASE)
    client.mongo.drop_database(DATABASE)
    uri = _client_uri(client, uri)
    items = sample_tasks(random.Random(7))
    client.publish_many(items)
    console.print(
        f"published {len(items)} sample tasks to database {DATABASE}; starting {WORKERS} workers",
        markup=False,
    )
    workers = [_spawn(uri, i) for i in range(1, WORKERS + 1)]
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
    )
    bar = progress.add_task("finished", total=len(items))
    started = time.monotonic()
    try:
        live = Live(progress, console=console, refresh_per_second=8)
        with live if console.is_terminal else contextlib.nullcontext():
            done = _watch(client, workers, len(items), started + seconds, progress, bar)
    finally:
        _stop(workers)
    if not console.is_terminal:  # a pipe: one line, not the bar's last frame
        took = time.monotonic() - started
        console.print(f"finished {done} of {len(items)} tasks in {took:.1f} s", markup=False)
    console.print()
    console.print(_where(client))
    doomed = client.get("doomed")
    if doomed is not None:
        console.print(
            f"'doomed' ended {doomed.status} after {doomed.attempts} attempts: "
            f"{(doomed.error or '').strip().splitlines()[-1]}",
            markup=False,
        )
    client.close()
    return 0 if done == len(items) else 1


def _watch(
    client: TaskClient,
    workers: list[subprocess.Popen[bytes]],
    total: int,
    deadline: float,
    progress: Progress,
    bar: Any,
) -> int:
    """Follow the tasks until all finished or ``deadline`` passed, killing the busiest worker
    once with SIGKILL; how many finished."""
    killed = False
    done = 0
    while time.monotonic() < deadline:
        counts = client.stats()
        done = sum(c.get("succeeded", 0) + c.get("failed", 0) for c in counts.values())
        progress.update(bar, completed=done)
        victim = _busiest(client) if not killed and done > 60 else None
        if victim is not None:
            workers[victim - 1].send_signal(signal.SIGKILL)
            killed = True
            progress.console.print(
                f"killed worker-{victim} with SIGKILL mid-run; its tasks are taken "
                "over when their leases run out (3 s)",
                markup=False,
            )
        if done == total:
            break
        time.sleep(0.25)
    return done


def _stop(workers: list[subprocess.Popen[bytes]]) -> None:
    for proc in workers:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in workers:
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()


def _client_uri(client: TaskClient, uri: str | None) -> str:
    from mtask.connection.clients import resolve_uri

    return resolve_uri(uri)
