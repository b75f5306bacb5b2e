"""A cancellation a driver call swallowed is raised all the same (Python 3.11's
``asyncio.wait_for``, which pymongo's async driver sends with, can drop one: gh-86296)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest

from mtask.driver import AsyncDriver, Call, Op


class Swallowing:
    """A collection whose ``find_one`` answers even when its task is cancelled meanwhile, as
    ``wait_for`` does when its inner future completes in the same turn as the cancel."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()

    async def find_one(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        self.entered.set()
        with contextlib.suppress(asyncio.CancelledError):  # no uncancel(): the request stays
            await asyncio.sleep(10)
        return {"_id": "k"}


def two_reads() -> Op[int]:
    yield Call("find_one", ({"_id": "k"},))
    yield Call("find_one", ({"_id": "k"},))
    return 2


async def test_a_swallowed_cancellation_is_raised() -> None:
    tasks = Swallowing()
    driver = AsyncDriver({"tasks": tasks})
    run = asyncio.create_task(driver.run(two_reads()))
    await tasks.entered.wait()
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run  # without the check the operation would go on to its second read
    assert run.cancelled()


async def test_no_cancellation_no_error() -> None:
    class Plain:
        async def find_one(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
            await asyncio.sleep(0)
            return {"_id": "k"}

    assert await AsyncDriver({"tasks": Plain()}).run(two_reads()) == 2
