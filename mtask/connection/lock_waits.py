"""A workaround for pymongo's condition waits on Python 3.11, where a task cancelled as its
wait times out can leave a lock of the client held for good (until pymongo or Python mends it).

pymongo's asynchronous API waits on a condition of its own ``Lock`` (server selection, a
pool's checkout) with ``pymongo.lock._async_cond_wait``: ``asyncio.wait_for(condition.wait(),
timeout)``. On Python 3.11 ``wait_for`` runs the wait in a task of its own. When the timeout
fires, it cancels that task and awaits its end, and the cancelled ``condition.wait()`` first
takes the lock back. If the outer task is cancelled meanwhile (a worker's side service at its
stop, a run stopped as lost, a caller's ``asyncio.timeout``) while another task holds the lock,
``wait_for`` returns at once without waiting: the outer task leaves its ``async with lock``,
releasing a lock it does not hold (another task's; or ``RuntimeError: Lock is not acquired``),
and the inner task takes the lock later and ends with nobody to release it. From then on, every
operation of the client waits on that lock for ever, with no error and no log: a worker stopped
finding, claiming and recording after a whole replica set was restarted under load, and a
stopping worker exited 1 on the ``RuntimeError``. From Python 3.12, ``wait_for`` waits in the
same task (with ``asyncio.timeout``), so the cancelled wait takes the lock back before it
leaves. ``install`` gives pymongo that same ``wait_for`` on Python 3.11 (``asyncio.timeout`` is
there since 3.11), once, by the first async client mtask makes. The report for pymongo, with a
reproduction, is ``docs/upstream/pymongo-cancelled-condition-wait.md``.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable
from typing import Any, TypeVar

T = TypeVar("T")

_installed = False
replaced: Any = None
"""pymongo's own ``wait_for``, once ``install`` put ``wait_for`` in its place."""


def affected(version: tuple[int, ...] | None = None) -> bool:
    """Whether ``asyncio.wait_for`` on this Python (or ``version``) waits in a task of its own
    (before 3.12)."""
    return (sys.version_info[:2] if version is None else version) < (3, 12)


async def wait_for(awaitable: Awaitable[T], timeout: float | None) -> T:  # noqa: ASYNC109
    """``asyncio.wait_for`` as Python 3.12 has it: the awaitable runs in the caller's task,
    under ``asyncio.timeout``, so a cancel reaches it directly and it ends before this does."""
    async with asyncio.timeout(timeout):
        return await awaitable


def install() -> None:
    """Put ``wait_for`` in the place of the one pymongo's condition waits use, once, on a
    Python whose ``asyncio.wait_for`` leaves the wait's task behind."""
    global _installed, replaced
    if _installed:
        return
    _installed = True
    try:
        from pymongo import lock
    except ImportError:  # another layout: nothing of ours to mend
        return
    module: Any = lock
    original = getattr(module, "wait_for", None)
    if affected() and original is asyncio.wait_for:
        replaced = original
        module.wait_for = wait_for
