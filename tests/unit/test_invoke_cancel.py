"""A run stopped while its handler runs under a time limit ends when its handler does, as an
await of the handler itself would: it records nothing (RELEASED at a stop) while a handler that
swallows its cancel still runs, so the drain sees it stuck and abandons it (its lease runs out)
instead of giving its task to another worker while it runs here."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from mtask.worker.running.invoke import limited


async def test_a_stopped_run_ends_only_when_its_handler_does() -> None:
    release = asyncio.Event()
    cancels = 0

    async def stubborn() -> str:
        nonlocal cancels
        while not release.is_set():
            try:
                await release.wait()
            except asyncio.CancelledError:
                cancels += 1
        return "ended"

    ctx: Any = SimpleNamespace(cancelled=asyncio.Event())
    run = asyncio.ensure_future(limited(stubborn(), ctx, None, 3600.0, "async"))
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    run.cancel()  # the worker's stop
    done, _ = await asyncio.wait({run}, timeout=0.2)
    assert not done and cancels == 1  # the handler swallowed it and runs: so does the run
    run.cancel()  # a second stop is passed on to the handler
    done, _ = await asyncio.wait({run}, timeout=0.2)
    assert not done and cancels == 2
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await run
