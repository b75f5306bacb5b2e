"""``mtask.worker.together``: the start-up's steps at once; the first to fail cancels the others
and its own error is raised (the start-up's retry reads its kind)."""

from __future__ import annotations

import asyncio

import pytest

from mtask.errors import StorageError
from mtask.worker import together


async def test_every_step_runs_at_once() -> None:
    began: list[str] = []
    both = asyncio.Event()

    async def step(name: str) -> None:
        began.append(name)
        if len(began) == 2:
            both.set()
        await both.wait()  # neither ends before the other has begun

    await asyncio.wait_for(together(step("a"), step("b")), timeout=10)
    assert sorted(began) == ["a", "b"]


async def slow(cancelled: asyncio.Event) -> None:
    """A step that never ends; ``cancelled`` is set when it is cancelled."""
    try:
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        cancelled.set()
        raise


async def test_the_first_failure_cancels_the_rest_and_is_raised_as_it_is() -> None:
    cancelled = asyncio.Event()
    failed = StorageError("down", transient=True)

    async def fails() -> None:
        await asyncio.sleep(0)
        raise failed

    with pytest.raises(StorageError) as caught:
        await asyncio.wait_for(together(slow(cancelled), fails()), timeout=10)
    assert caught.value is failed
    assert cancelled.is_set()  # awaited: nothing of the attempt runs on into the next


async def test_cancelling_it_cancels_its_steps() -> None:
    cancelled = asyncio.Event()
    task = asyncio.ensure_future(together(slow(cancelled), slow(cancelled)))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert cancelled.is_set()
