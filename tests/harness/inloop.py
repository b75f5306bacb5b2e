"""A worker inside the test's event loop, its events collected for the test to await."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from mtask.registry import Registry
from mtask.worker import Worker

from .events import Events


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
