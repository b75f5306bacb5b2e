"""On Python 3.11, pymongo's condition waits use a ``wait_for`` that waits in the caller's task
(``mtask.connection.lock_waits``; the reproduction with a real server: test_cancelled_waits)."""

from __future__ import annotations

import asyncio

import pytest
from pymongo import lock

from mtask.connection import lock_waits
from mtask.connection.clients import async_client

lock_waits.install()


def test_only_a_python_before_3_12_is_affected() -> None:
    assert lock_waits.affected((3, 11, 7)) and not lock_waits.affected((3, 12, 0))


def test_an_async_client_installs_it_where_pythons_wait_for_leaves_its_task() -> None:
    async_client("mongodb://127.0.0.1:1/?directConnection=true", connect=False)
    assert lock.wait_for is (lock_waits.wait_for if lock_waits.affected() else asyncio.wait_for)


async def test_the_stand_in_returns_the_result_or_times_out() -> None:
    assert await lock_waits.wait_for(asyncio.sleep(0, "done"), 1) == "done"
    assert await lock_waits.wait_for(asyncio.sleep(0, "done"), None) == "done"
    with pytest.raises(TimeoutError):
        await lock_waits.wait_for(asyncio.Event().wait(), 0.01)
    with pytest.raises(TimeoutError):  # a deadline already past, as a pool's checkout may give
        await lock_waits.wait_for(asyncio.Event().wait(), -1)


async def test_a_cancelled_wait_takes_its_lock_back_before_it_ends() -> None:
    """The property pymongo's code relies on: a task cancelled as its wait times out leaves its
    ``async with lock`` holding the lock, whoever held it meanwhile; the lock is free after."""
    held = lock._async_create_lock()
    condition = lock._async_create_condition(held)
    waiting = asyncio.Event()

    async def waiter() -> bool:
        async with held:
            waiting.set()
            return await lock._async_cond_wait(condition, 0.05)

    task = asyncio.create_task(waiter())
    await waiting.wait()
    await held.acquire()  # another task holds the lock as the wait times out
    await asyncio.sleep(0.1)
    task.cancel()
    await asyncio.sleep(0.01)
    assert not task.done()  # it waits for the lock, in its own task
    held.release()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not held.locked()
    await asyncio.wait_for(held.acquire(), 1)
    held.release()
