"""Run workers inside the test's event loop and await what they report."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import os
import subprocess
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

from mtask.registry import Registry
from mtask.testing import worker_argv
from mtask.worker import Worker

T0 = dt.datetime(2046, 3, 1, 12, 0, tzinfo=dt.UTC)
"""The start of an injected clock (``FixedClock``) in tests that do not wait. In the future:
a task finished at T0 expires (``expire_at``) after it, so MongoDB's TTL monitor, which goes
by the server's real clock, never removes a test's task while the test reads it."""


class Events:
    """Collects a worker's events; ``wait`` awaits one that matches, without polling."""

    def __init__(self) -> None:
        self.items: list[tuple[str, dict[str, Any]]] = []
        self._changed = asyncio.Event()

    def __call__(self, event: str, **data: Any) -> None:
        self.items.append((event, data))
        self._changed.set()

    def matching(self, event: str, **match: Any) -> list[dict[str, Any]]:
        return [
            d for e, d in self.items if e == event and all(d.get(k) == v for k, v in match.items())
        ]

    async def wait(
        self, event: str, timeout: float = 20.0, count: int = 1, **match: Any
    ) -> dict[str, Any]:
        async def until() -> dict[str, Any]:
            while True:
                found = self.matching(event, **match)
                if len(found) >= count:
                    return found[count - 1]
                self._changed.clear()
                await self._changed.wait()

        return await asyncio.wait_for(until(), timeout)


async def wait_for(check: Callable[[], Any], timeout: float = 20.0, every: float = 0.02) -> Any:
    """Await a condition on MongoDB state (for state no worker event reports)."""

    async def until() -> Any:
        while True:
            value = check()
            if asyncio.iscoroutine(value):
                value = await value
            if value:
                return value
            await asyncio.sleep(every)

    return await asyncio.wait_for(until(), timeout)


@contextlib.asynccontextmanager
async def running_worker(
    registry: Registry, uri: str, database: str, **kwargs: Any
) -> AsyncIterator[tuple[Worker, Events]]:
    events = Events()
    kwargs.setdefault("heartbeat_interval", 0.2)
    worker = Worker(registry, uri=uri, database=database, on_event=events, **kwargs)
    task = asyncio.create_task(worker.run())
    try:
        await asyncio.wait_for(_ready(worker, task), 30)
        yield worker, events
    finally:
        worker.stop(immediate=True)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 30)


async def _ready(worker: Worker, task: asyncio.Task[None]) -> None:
    while not worker.parts.finding.finder.ready.is_set():
        if task.done():
            task.result()
        await asyncio.sleep(0.01)


TESTS = Path(__file__).parent


@contextlib.contextmanager
def worker_process(uri: str, db: str, *extra: str) -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(
        worker_argv("workerapp:registry", uri, db, *extra),
        cwd=TESTS,
        env={**os.environ, "PYTHONPATH": str(TESTS)},
    )  # fmt: skip
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def pad_to_the_limit(collection: Any, key: str, short: int) -> None:
    """Pad task ``key``'s document (unknown fields are kept) to ``short`` bytes short of
    16 MiB, in two writes of half each (one write near 16 MiB strains a small cache)."""
    collection.update_one({"_id": key}, {"$set": {"padding": "", "more_padding": ""}})
    [size] = collection.aggregate(
        [{"$match": {"_id": key}}, {"$project": {"s": {"$bsonSize": "$$ROOT"}}}]
    )
    pad = 16 * 1024 * 1024 - short - size["s"]
    for half, length in (("padding", pad // 2), ("more_padding", pad - pad // 2)):
        collection.update_one({"_id": key}, {"$set": {half: "p" * length}})


def hand_written(now: dt.datetime, **fields: Any) -> dict[str, Any]:
    """A well-formed pending ``add`` task document as a service writes it by hand (no ``_id``
    unless given in ``fields``, which override what they name)."""
    return {
        "name": "add",
        "status": "pending",
        "next_claim_at": now,
        "available_at": now,
        "runs": [],
        "successes": 0,
        "failures": 0,
        "attempts": 0,
        "params": {"a": 1, "b": 1},
        "options": {
            "specific_worker_ids": [],
            "concurrency": 1,
            "max_retries": 1,
            "worker_timeout_ms": 1000,
            "ping_interval_ms": 100,
        },
        **fields,
    }


def run_cli(*argv: str, width: int = 80) -> tuple[int, str, str]:
    """``mtask …`` in-process with its consoles ``width`` columns wide: the exit status, what it
    printed (``--json`` included: it writes to ``sys.stdout``) and its stderr."""
    import contextlib
    import io

    from rich.console import Console

    from mtask.cli import common, main

    out, err = io.StringIO(), io.StringIO()
    saved = common.out._console, common.err._console
    common.out._console = Console(file=out, width=width, highlight=False)
    common.err._console = Console(file=err, width=width, highlight=False)
    try:
        with contextlib.redirect_stdout(out):
            code = main(list(argv))
    finally:
        common.out._console, common.err._console = saved
    return code, out.getvalue(), err.getvalue()
