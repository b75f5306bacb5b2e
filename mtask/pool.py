"""A pool of child processes for plain-``def`` handlers declared ``isolation="process"``.

Children are started with ``forkserver`` (never a plain ``fork`` of the threaded worker). One
child runs one handler call at a time; the parent sends ``(handler, params, context info)``
through a pipe and gets back a result, ``Retry``/``Fail`` (which keep their meaning), or a
traceback. ``await ProcessPool.run(...)`` is what the worker awaits instead of a thread.

A child is killed (SIGTERM, then SIGKILL after ``term_grace``) and replaced when its run hits
its hard time limit or is cancelled (a ``cancel``, a lost lease, the worker's stop after its
grace: the awaiting task is cancelled). A child that dies on its own (a signal, ``os._exit``)
ends its run with ``ChildDied`` ("handler process died: signal 11"). Children are recycled
after ``max_tasks_per_child`` runs or when their resident memory after a run exceeds
``max_memory_per_child`` bytes; ``memory_limit`` caps each child's address space
(``RLIMIT_AS``), so an allocation past it raises ``MemoryError`` in the child, not in the
worker. No child outlives the worker: each child asks the kernel for SIGKILL when its parent
dies (``PR_SET_PDEATHSIG``) and a thread in it exits the process when the worker's end of an
"alive" pipe closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import multiprocessing
import multiprocessing.connection
import os
import resource
import signal
import sys
import threading
import time
import traceback
from collections.abc import Mapping
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from typing import Any, cast

from mtask import metrics
from mtask.errors import InvalidParams, MtaskError
from mtask.registry import Fail, Handler, Retry, TaskContext

log = logging.getLogger("mtask.pool")

TRACEBACK_LIMIT = 4000
PR_SET_PDEATHSIG = 1


class HandlerError(MtaskError):
    """The handler raised in its child process; the message is the child's traceback."""


class ChildDied(MtaskError):
    """The child process running the handler died (a signal, ``os._exit``, a kill)."""


class TimeLimitExceeded(MtaskError):
    """The run reached its hard time limit; its child was killed."""


@dataclass(frozen=True)
class RunInfo:
    """What a child needs to build the handler's ``TaskContext``."""

    key: str
    name: str
    attempt: int
    run_id: str
    worker_id: str


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


# -- the child side -------------------------------------------------------------------------------


def _die_with_parent(alive: multiprocessing.connection.Connection, worker_pid: int) -> None:
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)

    def watch() -> None:
        with contextlib.suppress(EOFError, OSError):
            while True:
                alive.recv()  # the worker never sends: this returns only at EOF
        os._exit(70)

    threading.Thread(target=watch, name="mtask-child-watch", daemon=True).start()
    if os.getppid() == 1 or not _alive(worker_pid):
        os._exit(70)  # the worker died before the watch started


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _short_traceback(exc: BaseException) -> str:
    text = "".join(traceback.format_exception(exc))
    return text if len(text) <= TRACEBACK_LIMIT else "…" + text[-TRACEBACK_LIMIT:]


def _call(handler: Handler, params: Mapping[str, Any], info: RunInfo, cancelled: Any) -> tuple:  # type: ignore[type-arg]
    ctx = TaskContext(
        key=info.key,
        name=info.name,
        attempt=info.attempt,
        run_id=info.run_id,
        worker_id=info.worker_id,
        cancelled=cast(asyncio.Event, cancelled),  # a multiprocessing Event: is_set() works
    )
    try:
        return ("ok", handler.fn(*handler.args(handler.parse(params), ctx)))
    except Retry as exc:
        return ("retry", str(exc), exc.delay)
    except Fail as exc:
        return ("fail", str(exc))
    except InvalidParams as exc:
        return ("invalid", str(exc))
    except MemoryError as exc:
        return ("memory", _short_traceback(exc))
    except Exception as exc:  # noqa: BLE001 - any handler error is the task's failure
        return ("error", _short_traceback(exc))


def _child_main(
    conn: multiprocessing.connection.Connection,
    alive: multiprocessing.connection.Connection,
    cancelled: Any,
    worker_pid: int,
    memory_limit: int | None,
) -> None:
    _die_with_parent(alive, worker_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the worker's to handle
    if memory_limit is not None:
        resource.setrlimit(resource.RLIMIT_AS, (memory_limit, memory_limit))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return  # retired
        handler, params, info = message
        reply = _call(handler, params, info, cancelled)
        try:
            conn.send((*reply[:1], _rss_bytes(), *reply[1:]))
        except Exception as exc:  # noqa: BLE001 - e.g. a result that cannot be pickled
            conn.send(("error", _rss_bytes(), f"the result cannot be sent back: {exc!r}"))
        if reply[0] == "memory":
            return  # a child that ran out of memory is not trusted with another run


# -- the parent side ------------------------------------------------------------------------------


@dataclass
class Child:
    process: BaseProcess
    conn: multiprocessing.connection.Connection
    alive: multiprocessing.connection.Connection
    cancelled: Any
    tasks: int = 0
    busy_since: float | None = field(default=None)
    rss: int | None = None
    """Resident bytes the child reported after its last run."""


class ProcessPool:
    """Child processes for handler calls, started on demand and kept while idle."""

    def __init__(
        self,
        *,
        max_tasks_per_child: int | None = None,
        max_memory_per_child: int | None = None,
        memory_limit: int | None = None,
        term_grace: float = 1.0,
        start_method: str = "forkserver",
        preload: tuple[str, ...] = (),
    ) -> None:
        if start_method not in ("forkserver", "spawn"):
            raise MtaskError("the process pool starts children with forkserver or spawn")
        self.max_tasks_per_child = max_tasks_per_child
        self.max_memory_per_child = max_memory_per_child
        self.memory_limit = memory_limit
        self.term_grace = term_grace
        self._mp: Any = multiprocessing.get_context(start_method)
        if start_method == "forkserver":
            # children start warm: the forkserver imports the handlers' modules once, and
            # each child forked from it has them (a module that fails there is skipped)
            self._mp.set_forkserver_preload(["mtask.registry", *preload])
        self._idle: list[Child] = []
        self._busy: set[int] = set()
        self._children: dict[int, Child] = {}
        self.started = 0
        self.recycled = 0
        self.killed = 0
        self.died = 0
        self.time_limit_kills = 0
        self.closed = False

    # -- public ---------------------------------------------------------------------------------

    @property
    def pids(self) -> list[int]:
        return [c.process.pid for c in self._children.values() if c.process.pid is not None]

    def state(self) -> dict[str, int]:
        """Counts for metrics and the heartbeat: busy, idle, started, recycled, killed, died,
        time-limit kills."""
        return {
            "busy": len(self._busy),
            "idle": len(self._idle),
            "started": self.started,
            "recycled": self.recycled,
            "killed": self.killed,
            "died": self.died,
            "time_limit_kills": self.time_limit_kills,
        }

    def children(self, limit: int = 64) -> list[dict[str, Any]]:
        """Each live child for the heartbeat: pid, ``busy``/``idle``, runs done, the resident
        bytes it reported after its last run, and for how long its current run has run."""
        now = time.monotonic()
        out: list[dict[str, Any]] = []
        for pid, child in sorted(self._children.items())[:limit]:
            busy = id(child) in self._busy
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

    async def run(
        self,
        handler: Handler,
        params: Mapping[str, Any],
        info: RunInfo,
        *,
        soft_timeout: float | None = None,
        hard_timeout: float | None = None,
        cancelled: asyncio.Event | None = None,
    ) -> Any:
        """Run ``handler`` in a child and return its result, or raise what the run ended with:
        ``Retry``, ``Fail``, ``InvalidParams``, ``HandlerError`` (the child's traceback),
        ``MemoryError``-as-``HandlerError``, ``ChildDied``, ``TimeLimitExceeded``. At
        ``soft_timeout`` (or when ``cancelled`` is set) the child's ``ctx.cancelled`` is set;
        at ``hard_timeout``, or if this await is cancelled, the child is killed."""
        if self.closed:
            raise MtaskError("the process pool is closed")
        child = await self._take()
        try:
            child.conn.send((handler, dict(params), info))
            reply = await self._await_reply(child, soft_timeout, hard_timeout, cancelled)
        except BaseException:
            await self._kill(child)
            raise
        return self._settle(child, reply)

    async def start(self, count: int) -> None:
        """Start children until ``count`` are alive (a worker's boot, as Celery's prefork
        pool does): the first runs do not wait for the forkserver and the imports."""
        while len(self._children) < count and not self.closed:
            child = await asyncio.to_thread(self._start_child)
            self._idle.append(child)
            self._gauges()

    async def close(self) -> None:
        """Retire idle children and kill busy ones; wait until every child is reaped."""
        self.closed = True
        await asyncio.gather(*(self._kill(c) for c in list(self._children.values())))

    # -- children -------------------------------------------------------------------------------

    async def _take(self) -> Child:
        while self._idle:
            child = self._idle.pop()
            if child.process.is_alive():
                self._mark_busy(child)
                return child
            self._forget(child)
        child = await asyncio.to_thread(self._start_child)
        self._mark_busy(child)
        return child

    def _start_child(self) -> Child:
        parent_conn, child_conn = self._mp.Pipe()
        alive_r, alive_w = self._mp.Pipe(duplex=False)
        cancelled = self._mp.Event()
        process = self._mp.Process(
            target=_child_main,
            args=(child_conn, alive_r, cancelled, os.getpid(), self.memory_limit),
            name="mtask-child",
            daemon=True,
        )
        process.start()
        child_conn.close()
        alive_r.close()
        assert process.pid is not None
        child = Child(process, parent_conn, alive_w, cancelled)
        self._children[process.pid] = child
        self.started += 1
        metrics.POOL_CHILDREN_STARTED.inc()
        return child

    def _mark_busy(self, child: Child) -> None:
        child.cancelled.clear()
        child.busy_since = time.monotonic()
        self._busy.add(id(child))
        self._gauges()

    def _mark_idle(self, child: Child) -> None:
        child.busy_since = None
        self._busy.discard(id(child))
        self._gauges()

    def _gauges(self) -> None:
        busy = len(self._busy)
        metrics.POOL_CHILDREN.labels(state="busy").set(busy)
        metrics.POOL_CHILDREN.labels(state="idle").set(max(0, len(self._children) - busy))

    def _forget(self, child: Child) -> None:
        self._mark_idle(child)
        if child.process.pid is not None:
            self._children.pop(child.process.pid, None)
        self._gauges()
        for conn in (child.conn, child.alive):
            with contextlib.suppress(OSError):
                conn.close()
        with contextlib.suppress(ValueError):
            child.process.join(0)
            child.process.close()

    async def _await_reply(
        self,
        child: Child,
        soft_timeout: float | None,
        hard_timeout: float | None,
        cancelled: asyncio.Event | None,
    ) -> tuple[Any, ...] | None:
        """The child's reply, ``None`` if it died first; raises ``TimeLimitExceeded``."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        readable = _Readable(child.conn.fileno(), child.process.sentinel)
        soft_sent = False
        try:
            while True:
                now = loop.time()
                wait: float | None = None
                if hard_timeout is not None:
                    wait = max(0.0, start + hard_timeout - now)
                if not soft_sent and soft_timeout is not None:
                    left = max(0.0, start + soft_timeout - now)
                    wait = left if wait is None else min(wait, left)
                waiters: list[asyncio.Future[Any]] = [readable.future]
                stop = None
                if not soft_sent and cancelled is not None:
                    stop = asyncio.ensure_future(cancelled.wait())
                    waiters.append(stop)
                try:
                    await asyncio.wait(waiters, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    if stop is not None:
                        stop.cancel()
                if readable.future.done():
                    break
                now = loop.time()
                if hard_timeout is not None and now >= start + hard_timeout:
                    self.time_limit_kills += 1  # run() kills the child
                    raise TimeLimitExceeded(f"time limit exceeded ({hard_timeout:g} s)")
                if not soft_sent and (
                    (soft_timeout is not None and now >= start + soft_timeout)
                    or (cancelled is not None and cancelled.is_set())
                ):
                    child.cancelled.set()  # the child's ctx.cancelled
                    soft_sent = True
        finally:
            readable.close()
        if child.conn.poll():
            try:
                return cast(tuple[Any, ...], child.conn.recv())
            except (EOFError, OSError):
                return None
        return None

    def _settle(self, child: Child, reply: tuple[Any, ...] | None) -> Any:
        if reply is None:
            child.process.join(5)
            reason = describe_exit(child.process.exitcode)
            self.died += 1
            metrics.POOL_CHILDREN_ENDED.labels(reason="died").inc()
            self._forget(child)
            raise ChildDied(f"handler process died: {reason}")
        kind, rss, *rest = reply
        child.tasks += 1
        child.rss = rss
        self._mark_idle(child)
        recycle = kind == "memory" or (
            self.max_tasks_per_child is not None and child.tasks >= self.max_tasks_per_child
        )
        if self.max_memory_per_child is not None and rss > self.max_memory_per_child:
            recycle = True
        if recycle or self.closed:
            self._retire(child)
        else:
            self._idle.append(child)
        if kind == "ok":
            return rest[0]
        if kind == "retry":
            raise Retry(rest[0], delay=rest[1])
        if kind == "fail":
            raise Fail(rest[0])
        if kind == "invalid":
            raise InvalidParams(rest[0])
        raise HandlerError(rest[0])

    def _retire(self, child: Child) -> None:
        """Recycle a healthy child: ask it to exit, reap it in the background."""
        self.recycled += 1
        metrics.POOL_CHILDREN_ENDED.labels(reason="recycled").inc()
        with contextlib.suppress(OSError):
            child.conn.send(None)
        if child.process.pid is not None:
            self._children.pop(child.process.pid, None)
        self._gauges()

        def reap() -> None:
            child.process.join(self.term_grace + 5)
            if child.process.is_alive():
                child.process.kill()
                child.process.join()
            self._forget(child)

        threading.Thread(target=reap, name="mtask-child-reap", daemon=True).start()

    async def _kill(self, child: Child) -> None:
        """SIGTERM, then SIGKILL after ``term_grace``; reap; forget."""
        if child.process.pid is not None and child.process.is_alive():
            self.killed += 1
            metrics.POOL_CHILDREN_ENDED.labels(reason="killed").inc()
            child.cancelled.set()
            with contextlib.suppress(OSError):
                child.process.terminate()
            if not await _wait_fd(child.process.sentinel, self.term_grace):
                with contextlib.suppress(OSError):
                    child.process.kill()
                await _wait_fd(child.process.sentinel, None)
        self._forget(child)
        if child in self._idle:
            self._idle.remove(child)


class _Readable:
    """A future set when any of ``fds`` becomes readable (the pipe, the process sentinel)."""

    def __init__(self, *fds: int) -> None:
        self.loop = asyncio.get_running_loop()
        self.future: asyncio.Future[None] = self.loop.create_future()
        self.fds = fds
        for fd in fds:
            self.loop.add_reader(fd, self._ready)

    def _ready(self) -> None:
        if not self.future.done():
            self.future.set_result(None)

    def close(self) -> None:
        for fd in self.fds:
            self.loop.remove_reader(fd)
        if not self.future.done():
            self.future.cancel()


async def _wait_fd(fd: int, limit: float | None) -> bool:
    readable = _Readable(fd)
    try:
        await asyncio.wait([readable.future], timeout=limit)
        return readable.future.done() and not readable.future.cancelled()
    finally:
        readable.close()
