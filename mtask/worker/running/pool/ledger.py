"""The pool's children as the worker holds them: each one's handle (``Child``: started, told,
terminated, its death told), and the account the pool keeps of them (``Ledger``): which live,
which are idle and which busy, what ended how, the gauges, and what the heartbeat shows. The
reaper and the memory watch follow the ledger: a child it adds the reaper guards, a child it
marks busy the memory watch reads.
"""

from __future__ import annotations

import contextlib
import functools
import math
import multiprocessing.connection
import os
import signal
import time
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from typing import Any

from prometheus_client import Gauge

from mtask import metrics
from mtask.errors import MtaskError
from mtask.worker.running.pool import exchange, pipe
from mtask.worker.running.pool.child import child_main
from mtask.worker.running.pool.errors import ChildDied, MemoryLimitExceeded
from mtask.worker.running.pool.memory import MEMORY_POLL, MemoryWatch
from mtask.worker.running.pool.pipe import Bounds
from mtask.worker.running.pool.reaper import Reaper, killpg


def describe_exit(exitcode: int | None) -> str:
    """``signal 11 (SIGSEGV)`` or ``exit code 3``."""
    if exitcode is None:
        return "unknown exit"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            return f"signal {-exitcode}"
        return f"signal {-exitcode} ({name})"
    return f"exit code {exitcode}"


def _mib(n: int) -> str:
    return f"{n / (1024 * 1024):.0f} MiB"


@dataclass
class Child:
    """The worker's handle on one child: its pipe, the "alive" pipe's write end, its run's
    ``ctx.cancelled`` and lease deadline (shared memory), and what the pool knows of it."""

    process: BaseProcess
    conn: multiprocessing.connection.Connection
    alive: multiprocessing.connection.Connection
    cancelled: Any
    deadline: Any
    """The current run's lease deadline (``time.monotonic()``), shared with the child."""
    tasks: int = 0
    busy_since: float | None = field(default=None)
    rss: int | None = None
    """Resident bytes the child reported after its last run."""
    over_limit: int | None = None
    """The resident bytes for which the memory watch killed the child."""

    @classmethod
    def start(cls, mp: Any, bounds: Bounds) -> Child:
        """Start a child (``child.child_main``) from the multiprocessing context ``mp``."""
        parent_conn, child_conn = mp.Pipe()
        alive_r, alive_w = mp.Pipe(duplex=False)
        cancelled = mp.Event()
        deadline = mp.RawValue("d", math.inf)
        process = mp.Process(
            target=child_main,
            args=(child_conn, alive_r, cancelled, deadline, os.getpid(), bounds),
            name="mtask-child",
            daemon=True,
        )
        process.start()
        child_conn.close()
        alive_r.close()
        return cls(process, parent_conn, alive_w, cancelled, deadline)

    async def terminate(self, grace: float) -> None:
        """SIGTERM to the child and its process group, SIGKILL to the child after ``grace``
        seconds; returns once it has ended."""
        self.cancelled.set()
        with contextlib.suppress(OSError):
            self.process.terminate()
        killpg(self.process.pid, signal.SIGTERM)
        if not await exchange.wait_readable(self.process.sentinel, grace):
            with contextlib.suppress(OSError):
                self.process.kill()
            await exchange.wait_readable(self.process.sentinel, None)

    def death(self, stopped: pipe.Stopped | None, memory_limit: int | None) -> MtaskError:
        """What the run of a child that has ended raises: it stopped itself at its lease's
        deadline (``stopped``), the memory watch killed it, or it died."""
        if stopped is not None:
            return ChildDied(
                "handler process stopped itself: the run's lease ran out with no renewal "
                "from the worker (was the worker frozen?)"
            )
        if self.over_limit is not None:
            assert memory_limit is not None
            return MemoryLimitExceeded(
                f"memory limit exceeded: the handler's process reached {_mib(self.over_limit)} "
                f"resident, over its limit of {_mib(memory_limit)}; it was killed"
            )
        return ChildDied(f"handler process died: {describe_exit(self.process.exitcode)}")

    def close(self) -> None:
        """Close its pipes, and reap it if it has ended."""
        for conn in (self.conn, self.alive):
            with contextlib.suppress(OSError):
                conn.close()
        with contextlib.suppress(ValueError):
            self.process.join(0)
            self.process.close()


class Ledger:
    """The pool's children: ``live`` by pid, ``idle`` ones, ``busy`` ones (by ``id``), and
    the counts of how they were started and ended."""

    def __init__(self, memory_limit: int | None = None, memory_poll: float = MEMORY_POLL) -> None:
        self.idle: list[Child] = []
        self.busy: dict[int, Child] = {}
        self.live: dict[int, Child] = {}
        self.memory = (
            None
            if memory_limit is None
            else MemoryWatch(memory_limit, memory_poll, self.busy.values)
        )
        """The hard memory limit's watch: awake while a child is busy."""
        self.reaper = Reaper()
        """Every live child's group killed when the worker dies."""
        self.started = 0
        self.recycled = 0
        self.killed = 0
        self.died = 0
        self.time_limit_kills = 0
        self.memory_kills = 0

    @property
    def pids(self) -> list[int]:
        return [c.process.pid for c in self.live.values() if c.process.pid is not None]

    def state(self) -> dict[str, int]:
        """Counts for metrics and the heartbeat: busy, idle, started, recycled, killed, died,
        time-limit kills, memory-limit kills."""
        return {
            "busy": len(self.busy),
            "idle": len(self.idle),
            "started": self.started,
            "recycled": self.recycled,
            "killed": self.killed,
            "died": self.died,
            "time_limit_kills": self.time_limit_kills,
            "memory_kills": self.memory_kills,
        }

    def children(self, limit: int = 64) -> list[dict[str, Any]]:
        """Each live child for the heartbeat: pid, ``busy``/``idle``, runs done, the resident
        bytes it reported after its last run, and for how long its current run has run."""
        now = time.monotonic()
        out: list[dict[str, Any]] = []
        for pid, child in sorted(self.live.items())[:limit]:
            busy = id(child) in self.busy
            out.append(
                {
                    "pid": pid,
                    "state": "busy" if busy else "idle",
                    "tasks": child.tasks,
                    "rss": child.rss,
                    "busy_for": (
                        round(now - child.busy_since, 3)
                        if busy and child.busy_since is not None
                        else None
                    ),
                }
            )
        return out

    def add(self, child: Child) -> None:
        """A child just started: live, its group guarded by the reaper."""
        pid = child.process.pid
        assert pid is not None
        self.reaper.add(pid)  # the child leads the group of its pid
        self.live[pid] = child
        self.started += 1
        metrics.POOL_CHILDREN_STARTED.inc()

    def mark_busy(self, child: Child) -> None:
        child.cancelled.clear()
        child.busy_since = time.monotonic()
        self.busy[id(child)] = child
        self.gauges()
        if self.memory is not None:
            self.memory.wake()

    def mark_idle(self, child: Child) -> None:
        child.busy_since = None
        was_busy = self.busy.pop(id(child), None) is not None
        if was_busy and not self.busy and self.memory is not None:
            self.memory.rest()
        self.gauges()

    def gauges(self) -> None:
        busy_gauge, idle_gauge = self._gauge
        busy = len(self.busy)
        busy_gauge.set(busy)
        idle_gauge.set(max(0, len(self.live) - busy))

    @functools.cached_property
    def _gauge(self) -> tuple[Gauge, Gauge]:
        """The busy and idle series, looked up once (``labels()`` costs a run 6 µs a time)."""
        return metrics.POOL_CHILDREN.labels(state="busy"), metrics.POOL_CHILDREN.labels(
            state="idle"
        )

    def forget(self, child: Child) -> None:
        """A child gone (or going): no longer live, its pipes closed."""
        self.mark_idle(child)
        if child.process.pid is not None:
            self.live.pop(child.process.pid, None)
            self.reaper.remove(child.process.pid)
        self.gauges()
        child.close()

    def ended(self, reason: str) -> None:
        """A child ended: ``died``, ``memory_limit`` or ``killed``."""
        if reason == "memory_limit":
            self.memory_kills += 1
        elif reason == "killed":
            self.killed += 1
        else:
            self.died += 1
        metrics.POOL_CHILDREN_ENDED.labels(reason=reason).inc()

    def retired(self, child: Child) -> None:
        """A healthy child recycled: no longer live (it is reaped in the background)."""
        self.recycled += 1
        metrics.POOL_CHILDREN_ENDED.labels(reason="recycled").inc()
        if child.process.pid is not None:
            self.live.pop(child.process.pid, None)
        self.gauges()

    def close(self) -> list[Child]:
        """The pool closes: the memory watch stops; returns every live child (to kill)."""
        if self.memory is not None:
            self.memory.close()
        return list(self.live.values())
