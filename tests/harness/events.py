"""Awaiting what happens: a worker's events, a condition on MongoDB's state, a drained queue."""

from __future__ import annotations

import asyncio
import datetime as dt
import time
import traceback
from collections.abc import Awaitable, Callable
from typing import Any

from mtask import TaskClient


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


async def clear_of_a_window_end(
    now: Callable[[], Awaitable[dt.datetime]], seconds: float, margin: float = 30.0
) -> None:
    """Until the server's time (``now``: a client's ``now``) is ``margin`` seconds or more from
    the end of its current window of ``seconds`` (windows of tokens are aligned on the epoch):
    a test whose step must be refused by a full window then never meets the next window, which
    would admit it."""

    async def clear() -> bool:
        return (await now()).timestamp() % seconds < seconds - margin

    await wait_for(clear, timeout=margin + 30, every=0.5)


def poll(check: Callable[[], Any], limit: float, what: str, every: float = 0.02) -> float:
    """``wait_for`` for a test without an event loop: poll ``check`` until it holds (failing
    with ``what`` after ``limit`` seconds); returns when (monotonic) it first did."""
    deadline = time.monotonic() + limit
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(every)
    return time.monotonic()


async def until_finished(
    client: TaskClient,
    total: int,
    timeout: float,
    explain: Callable[[], str] | None = None,
) -> None:
    """Wait until ``total`` tasks exist and none is pending or running. If they do not in
    ``timeout`` seconds, the failure says what ``explain`` reports then (a cluster's
    ``explainer``: the open tasks, the workers' logs…), or why it could not."""
    deadline = time.monotonic() + timeout
    counts: dict[str, int] = {}
    while time.monotonic() < deadline:
        try:
            counts = {}
            for by_status in client.stats(exact=True).values():
                for status, n in by_status.items():
                    counts[status] = counts.get(status, 0) + n
        except Exception:  # noqa: BLE001 - MongoDB may be failing over; ask again
            await asyncio.sleep(0.5)
            continue
        open_ = counts.get("pending", 0) + counts.get("running", 0)
        if sum(counts.values()) >= total and open_ == 0:
            return
        await asyncio.sleep(0.2)
    message = f"tasks still open after {timeout}s (of {total} expected): {counts}"
    if explain is not None:
        try:
            message += "\n" + explain()
        except Exception:  # noqa: BLE001 - the timeout is the failure, not its explanation
            message += "\n(explain failed)\n" + traceback.format_exc(limit=5)
    raise AssertionError(message)
