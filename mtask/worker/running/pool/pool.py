"""A pool of child processes for plain-``def`` handlers declared ``isolation="process"``.

Children are started with ``forkserver`` (never a plain ``fork`` of the threaded worker). One
child runs one handler call at a time; the parent sends ``(handler, params, context info)``
through a pipe and gets back a result, ``Retry``/``Fail`` (which keep their meaning), or a
traceback. ``await ProcessPool.run(...)`` is what the worker awaits instead of a thread.
Before its reply a child may send its handler's output (``("out", batch)``) and requests
about its durable steps (``("step", ...)``, answered on the pipe: ``pool_steps``); a run that
ends sleeping or waiting, or misuses a step, raises ``Suspended``/``StepError`` here as on a
thread.

A child is killed (SIGTERM, then SIGKILL after ``term_grace``) and replaced when its run hits
its hard time limit or is cancelled (a ``cancel``, a lost lease, the worker's stop after its
grace: the awaiting task is cancelled). A child that dies on its own (a signal, ``os._exit``)
ends its run with ``ChildDied`` ("handler process died: signal 11"). Children are recycled
after ``max_tasks_per_child`` runs or when their resident memory after a run exceeds
``max_memory_per_child`` bytes (Celery's soft limit). ``memory_limit`` is the hard one: a
thread of the parent reads each busy child's resident set every ``memory_poll`` seconds and
SIGKILLs a child past it; its run ends with ``MemoryLimitExceeded``.

Containment (docs/isolation.md, "Children bounded and contained"): each child leads a process
group of its own, which every process its handler starts inherits, and is a subreaper, so
orphaned descendants are re-parented to it. What a run leaves running is killed before its
reply is sent; a child that is killed or dies has its whole group SIGKILLed by the parent; and
if the worker itself dies (even by SIGKILL), a small guard process the pool starts (it holds
nothing but the pool's list of groups, on its stdin) sees its stdin close and SIGKILLs every
group. The child also asks for SIGKILL when its kernel parent dies (``PR_SET_PDEATHSIG``) and
a thread in it exits when the worker's end of an "alive" pipe closes. A child stops itself,
and its group, when the lease of its run runs out with no renewal from the parent (the
``LeasePinger`` passes each renewal, as a ``time.monotonic()`` deadline in shared memory): a
frozen worker's children stop by the deadline. What runs in the child is
``mtask.worker.running.pool.child``; this module is the parent's side.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import multiprocessing
import multiprocessing.connection
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from multiprocessing.reduction import ForkingPickler
from typing import Any, cast

from mtask import metrics
from mtask.errors import InvalidParams, MtaskError
from mtask.output import Batch
from mtask.registry import Fail, Handler, Retry
from mtask.steps import StepError, Suspended
from mtask.worker.config import DEFAULT_MAX_RESULT_BYTES
from mtask.worker.running.failures import short_traceback
from mtask.worker.running.pool.child import Bounds, RunInfo, child_main, rss_of
from mtask.worker.running.pool.child_steps import sendable

log = logging.getLogger("mtask.pool")  # the name operators filter on, kept

MEMORY_POLL = 0.1
"""Seconds between two reads of a busy child's resident set, with a hard memory limit."""
LeaseWatch = Callable[[Callable[[float], None]], Callable[[], None]]
"""Subscribes to a run's lease: called with a function that is given the lease's expiry
(``time.monotonic()`` seconds) now and at each renewal; returns the unsubscribe."""
OnStep = Callable[[str, tuple[Any, ...]], Awaitable[Any]]
"""Answers a child's request about its run's durable steps (``pool_steps.ParentSteps``)."""


class HandlerError(MtaskError):
    """The handler raised in its child process; the message is the child's traceback."""


class ChildDied(MtaskError):
    """The child process running the handler died (a signal, ``os._exit``, a kill)."""


class TimeLimitExceeded(MtaskError):
    """The run reached its hard time limit; its child was killed."""


class MemoryLimitExceeded(MtaskError):
    """The child's resident memory passed the pool's hard ``memory_limit``; it was killed."""


class ReplyRefused(MtaskError):
    """What the child sent is over its bound (``Bounds``): a result too large to store, refused
    in the child, or a message the worker would not read (its child was killed). The run fails
    for good, as a thread's with that result does."""


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


# -- the guard ------------------------------------------------------------------------------------


GUARD_CODE = """
import os, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)
groups = set()
for line in sys.stdin.buffer:
    pid = int(line[1:])
    if line[:1] == b"+":
        groups.add(pid)
    else:
        groups.discard(pid)
for pid in groups:
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass
"""
"""The guard: reads ``+PGID``/``-PGID`` lines; at EOF (the pool closed, or the worker died,
even by SIGKILL: only the worker holds the write end) SIGKILLs every group still listed."""


class _Guard:
    """The pool's guard process (``GUARD_CODE``): started with the first child, in a session
    of its own (signals for the worker's process group do not reach it), outliving the worker
    by the moment it takes to kill the children's groups."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._process: subprocess.Popen[bytes] | None = None

    def _send(self, line: str) -> None:
        with self._lock:
            if self._process is None:
                self._process = subprocess.Popen(
                    [sys.executable, "-I", "-S", "-c", GUARD_CODE],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.DEVNULL,
                    start_new_session=True,
                )
            stdin = self._process.stdin
            assert stdin is not None
            with contextlib.suppress(OSError, ValueError):
                stdin.write(line.encode() + b"\n")
                stdin.flush()

    def add(self, pgid: int) -> None:
        self._send(f"+{pgid}")

    def remove(self, pgid: int) -> None:
        if self._process is not None:
            self._send(f"-{pgid}")

    def close(self) -> None:
        with self._lock:
            process, self._process = self._process, None
        if process is not None:
            with contextlib.suppress(OSError, ValueError):
                assert process.stdin is not None
                process.stdin.close()
            try:
                process.wait(5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _killpg(pgid: int | None, sig: int = signal.SIGKILL) -> None:
    if pgid is not None:
        with contextlib.suppress(OSError):
            os.killpg(pgid, sig)


@dataclass
class Child:
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


class ProcessPool:
    """Child processes for handler calls, started on demand and kept while idle."""

    def __init__(
        self,
        *,
        max_tasks_per_child: int | None = None,
        max_memory_per_child: int | None = None,
        memory_limit: int | None = None,
        memory_poll: float = MEMORY_POLL,
        term_grace: float = 1.0,
        start_method: str = "forkserver",
        preload: tuple[str, ...] = (),
        bounds: Bounds | None = None,
    ) -> None:
        if start_method not in ("forkserver", "spawn"):
            raise MtaskError("the process pool starts children with forkserver or spawn")
        self.max_tasks_per_child = max_tasks_per_child
        self.max_memory_per_child = max_memory_per_child
        self.memory_limit = memory_limit
        """Resident bytes past which a busy child is killed (its run fails)."""
        self.memory_poll = memory_poll
        self.term_grace = term_grace
        self.bounds = bounds or Bounds.of(DEFAULT_MAX_RESULT_BYTES)
        """The most a child sends at once: a longer message is refused, never read."""
        self._mp: Any = multiprocessing.get_context(start_method)
        if start_method == "forkserver":
            # children start warm: the forkserver imports the handlers' modules once, and
            # each child forked from it has them (a module that fails there is skipped)
            self._mp.set_forkserver_preload(["mtask.registry", *preload])
        self._idle: list[Child] = []
        self._busy: dict[int, Child] = {}
        self._any_busy = threading.Event()
        self._memory_watch: threading.Thread | None = None
        self._guard = _Guard()
        self._children: dict[int, Child] = {}
        self.started = 0
        self.recycled = 0
        self.killed = 0
        self.died = 0
        self.time_limit_kills = 0
        self.memory_kills = 0
        self.closed = False

    # -- public ---------------------------------------------------------------------------------

    @property
    def pids(self) -> list[int]:
        return [c.process.pid for c in self._children.values() if c.process.pid is not None]

    def state(self) -> dict[str, int]:
        """Counts for metrics and the heartbeat: busy, idle, started, recycled, killed, died,
        time-limit kills, memory-limit kills."""
        return {
            "busy": len(self._busy),
            "idle": len(self._idle),
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
        lease: LeaseWatch | None = None,
        on_output: Callable[[Batch], None] | None = None,
        on_step: OnStep | None = None,
    ) -> Any:
        """Run ``handler`` in a child and return its result, or raise what the run ended with:
        ``Retry``, ``Fail``, ``InvalidParams``, ``HandlerError`` (the child's traceback),
        ``MemoryError``-as-``HandlerError``, ``ChildDied``, ``TimeLimitExceeded``,
        ``MemoryLimitExceeded``. At ``soft_timeout`` (or when ``cancelled`` is set) the child's
        ``ctx.cancelled`` is set; at ``hard_timeout``, or if this await is cancelled, the child
        is killed. With ``lease``, the child follows the run's lease expiry and stops itself
        (and everything its handler started) if it passes with no renewal. ``on_output``
        receives what the handler says (``ctx.progress``/``log``/``emit``), as it says it;
        ``on_step`` answers its durable steps' requests (``pool_steps``): a handler that
        sleeps or waits raises ``Suspended`` here, a step it misuses ``StepError``."""
        if self.closed:
            raise MtaskError("the process pool is closed")
        child = await self._take()
        unwatch: Callable[[], None] | None = None
        try:
            if lease is not None:
                deadline = child.deadline

                def renewed(expiry: float) -> None:  # on the pinger's thread
                    deadline.value = expiry

                unwatch = lease(renewed)
            child.conn.send((handler, dict(params), info))
            reply = await self._await_reply(
                child,
                soft_timeout,
                hard_timeout,
                cancelled,
                on_output or (lambda _b: None),
                on_step or _no_steps,
            )
        except BaseException:
            await self._kill(child)
            raise
        finally:
            if unwatch is not None:
                unwatch()
            child.deadline.value = math.inf
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
        self._any_busy.set()  # the memory watch sees ``closed`` and ends
        await asyncio.gather(*(self._kill(c) for c in list(self._children.values())))
        await asyncio.to_thread(self._guard.close)

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
        deadline = self._mp.RawValue("d", math.inf)
        process = self._mp.Process(
            target=child_main,
            args=(child_conn, alive_r, cancelled, deadline, os.getpid(), self.bounds),
            name="mtask-child",
            daemon=True,
        )
        process.start()
        child_conn.close()
        alive_r.close()
        assert process.pid is not None
        self._guard.add(process.pid)  # the child leads the group of its pid
        child = Child(process, parent_conn, alive_w, cancelled, deadline)
        self._children[process.pid] = child
        self.started += 1
        metrics.POOL_CHILDREN_STARTED.inc()
        return child

    def _mark_busy(self, child: Child) -> None:
        child.cancelled.clear()
        child.busy_since = time.monotonic()
        self._busy[id(child)] = child
        self._gauges()
        if self.memory_limit is not None:
            self._any_busy.set()
            if self._memory_watch is None:
                self._memory_watch = threading.Thread(
                    target=self._watch_memory, name="mtask-pool-memory", daemon=True
                )
                self._memory_watch.start()

    def _mark_idle(self, child: Child) -> None:
        child.busy_since = None
        if self._busy.pop(id(child), None) is not None and not self._busy:
            self._any_busy.clear()
        self._gauges()

    def _watch_memory(self) -> None:
        """On a thread (a handler blocking the event loop does not stop it): SIGKILL the
        group of a busy child whose resident set is past ``memory_limit``."""
        limit = self.memory_limit
        assert limit is not None
        while True:
            self._any_busy.wait()
            if self.closed:
                return
            for child in list(self._busy.values()):
                with contextlib.suppress(ValueError, OSError):  # closed, or gone
                    pid = child.process.pid
                    rss = None if pid is None else rss_of(pid)
                    if rss is None or rss <= limit or child.over_limit is not None:
                        continue
                    if child.busy_since is None:
                        continue  # its run has just ended
                    child.over_limit = rss
                    _killpg(pid)
                    child.process.kill()  # in case it has not made its group yet
            time.sleep(self.memory_poll)

    def _gauges(self) -> None:
        busy = len(self._busy)
        metrics.POOL_CHILDREN.labels(state="busy").set(busy)
        metrics.POOL_CHILDREN.labels(state="idle").set(max(0, len(self._children) - busy))

    def _forget(self, child: Child) -> None:
        self._mark_idle(child)
        if child.process.pid is not None:
            self._children.pop(child.process.pid, None)
            self._guard.remove(child.process.pid)
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
        on_output: Callable[[Batch], None],
        on_step: OnStep,
    ) -> tuple[Any, ...] | None:
        """The child's reply, ``None`` if it died first; raises ``TimeLimitExceeded``. What
        the child sends before it goes to ``on_output`` (its handler's output) or is answered
        by ``on_step`` (its steps' requests, answered while the limits are kept)."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        readable = _Readable(child.conn.fileno(), child.process.sentinel)
        soft_sent = False
        answering: set[asyncio.Future[None]] = set()
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
                    message = self._received(child)
                    if message is None or message[0] not in ("out", "step"):
                        return message
                    if message[0] == "out":
                        on_output(message[1])  # then the limits, as if nothing had come
                    else:  # the child waits for the answer; the limits are kept meanwhile
                        answer = asyncio.ensure_future(_answer(child, on_step, *message[1:]))
                        answering.add(answer)
                        answer.add_done_callback(answering.discard)
                    readable.close()
                    readable = _Readable(child.conn.fileno(), child.process.sentinel)
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
            for pending in list(answering):  # the run ended (a limit, a death): nobody asks now
                pending.cancel()

    def _received(self, child: Child) -> tuple[Any, ...] | None:
        """The next message from a child whose pipe or sentinel is ready; ``None`` if it died
        with nothing more to say. A message longer than ``bounds.message`` is not read
        (``ReplyRefused``; the run kills the child); one that cannot be unpickled here, whatever
        it raises (a ``SystemExit``, a ``CancelledError``), is the run's ``HandlerError``."""
        if not child.conn.poll():
            return None
        try:
            frame = child.conn.recv_bytes(self.bounds.message)
        except EOFError:
            return None
        except OSError:
            if child.conn.readable:
                return None  # a read error: it died mid-message
            raise ReplyRefused(  # too long: its length was read, not the rest
                f"the handler's process sent a message of more than {self.bounds.message} "
                "bytes; it was killed"
            ) from None
        try:
            return cast(tuple[Any, ...], ForkingPickler.loads(frame))
        except BaseException as exc:  # noqa: BLE001 - raised by what the child sent, not here
            raise HandlerError(short_traceback(exc)) from None

    def _settle(self, child: Child, reply: tuple[Any, ...] | None) -> Any:
        if reply is None or reply[0] == "lease":
            raise self._ended(child, reply)
        kind, rss, *rest = reply
        child.tasks += 1
        child.rss = rss
        self._mark_idle(child)
        recycle = kind == "memory" or (
            self.max_tasks_per_child is not None and child.tasks >= self.max_tasks_per_child
        )
        # past the hard limit too: its next run would be killed at once
        limits = [n for n in (self.max_memory_per_child, self.memory_limit) if n is not None]
        if child.over_limit is not None:  # killed for its memory just after it replied
            self._count_ended("memory_limit")
            self._forget(child)
        elif recycle or self.closed or any(rss > n for n in limits):
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
        if kind == "refused":
            raise ReplyRefused(rest[0])
        if kind == "suspended":
            raise Suspended(rest[0])
        if kind == "raise":
            raise rest[0]
        raise HandlerError(rest[0])

    def _ended(self, child: Child, reply: tuple[Any, ...] | None) -> MtaskError:
        """Forget a child that ended its run by dying (``reply`` None: killed for its
        memory, or died) or by stopping itself at its lease deadline; what the run raises."""
        child.process.join(5)  # ended, or ending: the lease watch is killing it
        exit_reason = describe_exit(child.process.exitcode)
        _killpg(child.process.pid)  # what its handler started dies with it
        over = child.over_limit
        self._count_ended("died" if over is None else "memory_limit")
        self._forget(child)
        if reply is not None:
            return ChildDied(
                "handler process stopped itself: the run's lease ran out with no renewal "
                "from the worker (was the worker frozen?)"
            )
        if over is not None:
            assert self.memory_limit is not None
            return MemoryLimitExceeded(
                f"memory limit exceeded: the handler's process reached {_mib(over)} "
                f"resident, over its limit of {_mib(self.memory_limit)}; it was killed"
            )
        return ChildDied(f"handler process died: {exit_reason}")

    def _count_ended(self, reason: str) -> None:
        if reason == "memory_limit":
            self.memory_kills += 1
        else:
            self.died += 1
        metrics.POOL_CHILDREN_ENDED.labels(reason=reason).inc()

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
        """SIGTERM, then SIGKILL after ``term_grace``, to the child's whole process group;
        reap; forget."""
        pid = child.process.pid
        if pid is not None and child.process.is_alive():
            self.killed += 1
            metrics.POOL_CHILDREN_ENDED.labels(reason="killed").inc()
            child.cancelled.set()
            with contextlib.suppress(OSError):
                child.process.terminate()
            _killpg(pid, signal.SIGTERM)
            if not await _wait_fd(child.process.sentinel, self.term_grace):
                with contextlib.suppress(OSError):
                    child.process.kill()
                await _wait_fd(child.process.sentinel, None)
        _killpg(pid)
        self._forget(child)
        if child in self._idle:
            self._idle.remove(child)


async def _answer(child: Child, on_step: OnStep, op: str, args: tuple[Any, ...]) -> None:
    """Answer a child's request about its steps: ``("ok", value)`` or ``("error", exc)``."""
    try:
        reply: tuple[str, Any] = ("ok", await on_step(op, args))
    except Exception as exc:  # noqa: BLE001 - raised in the child, as itself
        reply = ("error", sendable(exc))
    try:
        child.conn.send(reply)
    except (OSError, ValueError):
        return  # the child is gone, or going: its run ends anyway
    except Exception as exc:  # noqa: BLE001 - an answer that cannot be pickled
        with contextlib.suppress(OSError, ValueError):
            child.conn.send(("error", StepError(f"the answer cannot be sent: {exc!r}")))


async def _no_steps(op: str, args: tuple[Any, ...]) -> Any:
    raise StepError("this run has no journal for durable steps")


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
