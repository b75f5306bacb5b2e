"""The pool's hard memory limit (``memory_limit``): a thread of the worker reads each busy
child's resident set every ``poll`` seconds and SIGKILLs the group of one past the limit; its
run ends with ``MemoryLimitExceeded`` (``pool.py``). On a thread, so that a handler blocking the
worker's event loop does not stop it; asleep while no child is busy. A pool without the limit
has no watch (Celery's ``max_memory_per_child`` is the soft limit, checked after each run, in
the pool)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterable
from multiprocessing.process import BaseProcess
from typing import Protocol

from mtask.worker.running.pool.child import rss_of
from mtask.worker.running.pool.reaper import killpg

MEMORY_POLL = 0.1
"""Seconds between two reads of a busy child's resident set, with a hard memory limit."""


class Watched(Protocol):
    """A busy child as the watch sees it (``pool.Child``)."""

    process: BaseProcess
    busy_since: float | None
    """``None`` once its run has ended."""
    over_limit: int | None
    """The resident bytes for which the watch killed it."""


class MemoryWatch:
    """Kills a busy child past ``limit`` resident bytes, noting them in its ``over_limit``;
    ``busy`` lists the busy children. The thread starts with the first busy child."""

    def __init__(self, limit: int, poll: float, busy: Callable[[], Iterable[Watched]]) -> None:
        self.limit, self.poll, self.busy = limit, poll, busy
        self._any_busy = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False

    def wake(self) -> None:
        """A child became busy: watch (the first time, start the thread)."""
        self._any_busy.set()
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._watch, name="mtask-pool-memory", daemon=True
            )
            self._thread.start()

    def rest(self) -> None:
        """No child is busy: sleep until one is."""
        if not self._closed:  # else the thread, between two looks, would wait for ever
            self._any_busy.clear()

    def close(self) -> None:
        """The thread ends (at its next look)."""
        self._closed = True
        self._any_busy.set()

    def _watch(self) -> None:
        while True:
            self._any_busy.wait()
            if self._closed:
                return
            for child in list(self.busy()):
                with contextlib.suppress(ValueError, OSError):  # closed, or gone
                    self._look(child)
            time.sleep(self.poll)

    def _look(self, child: Watched) -> None:
        pid = child.process.pid
        rss = None if pid is None else rss_of(pid)
        if rss is None or rss <= self.limit or child.over_limit is not None:
            return
        if child.busy_since is None:
            return  # its run has just ended
        child.over_limit = rss
        killpg(pid)
        child.process.kill()  # in case it has not made its group yet
