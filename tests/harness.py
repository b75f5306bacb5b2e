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


STOP_WITHIN = 30.0
"""How long a worker may take to stop once told; past it the harness fails the test (a hang)."""


@contextlib.asynccontextmanager
async def running_worker(
    registry: Registry, uri: str, database: str, *, crash_expected: bool = False, **kwargs: Any
) -> AsyncIterator[tuple[Worker, Events]]:
    """A worker in the test's loop, stopped at the end. A worker that crashed (its ``run``
    raised) or did not stop within ``STOP_WITHIN`` fails the test that passed otherwise, unless
    the test says it expects a crash (``crash_expected``)."""
    events = Events()
    kwargs.setdefault("heartbeat_interval", 0.2)
    worker = Worker(registry, uri=uri, database=database, on_event=events, **kwargs)
    task = asyncio.create_task(worker.run())
    try:
        await asyncio.wait_for(_ready(worker, task), 30)
        yield worker, events
    except BaseException:
        worker.stop(immediate=True)
        with contextlib.suppress(Exception, asyncio.CancelledError):
            await asyncio.wait_for(task, STOP_WITHIN)
        raise
    worker.stop(immediate=True)
    await _verdict(task, crash_expected)


async def _verdict(task: asyncio.Task[None], crash_expected: bool) -> None:
    try:
        await asyncio.wait_for(task, STOP_WITHIN)
    except TimeoutError:
        raise AssertionError(f"the worker did not stop within {STOP_WITHIN} s (a hang)") from None
    except Exception as exc:
        if not crash_expected:
            raise AssertionError(f"the worker crashed: {exc!r}") from exc
        return
    if crash_expected:
        raise AssertionError("the test expected the worker to crash, and it stopped cleanly")


async def _ready(worker: Worker, task: asyncio.Task[None]) -> None:
    while not worker.parts.finding.finder.ready.is_set():
        if task.done():
            task.result()
        await asyncio.sleep(0.01)


TESTS = Path(__file__).parent


ROOT = TESTS.parent


def tree_env(**more: str) -> dict[str, str]:
    """The environment of a subprocess that runs the tree under test (this checkout's
    ``mtask`` first, whatever is installed) and the tests' apps (``workerapp`` …)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(ROOT)]), **more}


@contextlib.contextmanager
def worker_process(
    uri: str, db: str, *extra: str, crash_expected: bool = False
) -> Iterator[subprocess.Popen[bytes]]:
    """``mtask-worker`` as a process of the tree under test, stopped by SIGTERM at the end. One
    that exits with anything but 0 (a crash, a kill) or does not stop within ``STOP_WITHIN``
    fails the test that passed otherwise, unless the test expects it (``crash_expected``)."""
    proc = subprocess.Popen(
        worker_argv("workerapp:registry", uri, db, *extra), cwd=TESTS, env=tree_env()
    )
    try:
        yield proc
    except BaseException:
        _stop(proc)
        raise
    if not _stop(proc):
        raise AssertionError(f"the worker process did not stop within {STOP_WITHIN} s of SIGTERM")
    if proc.returncode != 0 and not crash_expected:
        raise AssertionError(f"the worker process exited with {proc.returncode} (a crash?)")


def _stop(proc: subprocess.Popen[bytes]) -> bool:
    """SIGTERM, then SIGKILL past ``STOP_WITHIN``; whether it stopped in time."""
    proc.terminate()
    try:
        proc.wait(timeout=STOP_WITHIN)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return False
    return True


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
