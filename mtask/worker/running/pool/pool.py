"""A pool of child processes for plain-``def`` handlers declared ``isolation="process"``.

Children are started with ``forkserver`` (never a plain ``fork`` of the threaded worker). One
child runs one handler call at a time; the parent sends it a ``pipe.Call`` and gets back a
``pipe.Reply``: a result, ``Retry``/``Fail`` (which keep their meaning), or a traceback.
``await ProcessPool.run(...)`` is what the worker awaits instead of a thread. Before its reply
a child may send its handler's output and requests about its durable steps (``exchange``:
``child_steps`` answers them); a run that ends sleeping or waiting, or misuses a step, raises
``Suspended``/``StepError`` here as on a thread.

A child is killed (SIGTERM, then SIGKILL after ``term_grace``) and replaced when its run hits
its hard time limit or is cancelled (a ``cancel``, a lost lease, the worker's stop after its
grace: the awaiting task is cancelled). A child that dies on its own (a signal, ``os._exit``)
ends its run with ``ChildDied`` ("handler process died: signal 11"). Children are recycled
after ``max_tasks_per_child`` runs or when their resident memory after a run exceeds
``max_memory_per_child`` bytes (Celery's soft limit). ``memory_limit`` is the hard one: a
thread of the parent (``memory.MemoryWatch``) reads each busy child's resident set every
``memory_poll`` seconds and SIGKILLs a child past it; its run ends with
``MemoryLimitExceeded``.

Containment (docs/isolation.md, "Children bounded and contained"): each child leads a process
group of its own, which every process its handler starts inherits, and is a subreaper, so
orphaned descendants are re-parented to it. What a run leaves running is killed before its
reply is sent; a child that is killed or dies has its whole group SIGKILLed by the parent; and
if the worker itself dies (even by SIGKILL), a small reaper process the pool starts
(``reaper.Reaper``: it holds nothing but the pool's list of groups, on its stdin) sees its stdin
close and SIGKILLs every group. The child also asks for SIGKILL when its kernel parent dies
(``PR_SET_PDEATHSIG``) and a thread in it exits when the worker's end of an "alive" pipe
closes. A child stops itself, and its group, when the lease of its run runs out with no
renewal from the parent (the ``LeasePinger`` passes each renewal, as a ``time.monotonic()``
deadline in shared memory): a frozen worker's children stop by the deadline.

The parts: ``pipe`` (every message between worker and child, and its bounds), ``exchange`` (one
run's messages until its reply, and its time limits), ``memory`` (the hard memory limit),
``reaper``, ``errors``, ``ledger`` (each child's handle, and the account of them all: live,
idle, busy, ended how); what runs in the child is ``child`` and ``child_steps``. This module is
the children's life: started, taken for a run, kept or recycled after it, killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import multiprocessing
import multiprocessing.connection
import threading
from collections.abc import Callable, Mapping
from typing import Any

from mtask.errors import MtaskError
from mtask.follow.output import Batch
from mtask.registry import Handler
from mtask.worker.config import DEFAULT_MAX_RESULT_BYTES
from mtask.worker.running.pool import exchange, pipe
from mtask.worker.running.pool.errors import TimeLimitExceeded
from mtask.worker.running.pool.exchange import OnStep, RunLimits
from mtask.worker.running.pool.ledger import Child, Ledger
from mtask.worker.running.pool.memory import MEMORY_POLL
from mtask.worker.running.pool.pipe import Bounds, RunInfo
from mtask.worker.running.pool.reaper import killpg

log = logging.getLogger("mtask.pool")  # the name operators filter on, kept

LeaseWatch = Callable[[Callable[[float], None]], Callable[[], None]]
"""Subscribes to a run's lease: called with a function that is given the lease's expiry
(``time.monotonic()`` seconds) now and at each renewal; returns the unsubscribe."""


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
        self._ledger = Ledger(memory_limit, memory_poll)
        """The children: which live, idle or busy, and what ended how."""
        self.closed = False

    # -- public ---------------------------------------------------------------------------------

    @property
    def pids(self) -> list[int]:
        return self._ledger.pids

    def state(self) -> dict[str, int]:
        """Counts for metrics and the heartbeat (``Ledger.state``)."""
        return self._ledger.state()

    def children(self, limit: int = 64) -> list[dict[str, Any]]:
        """Each live child for the heartbeat (``Ledger.children``)."""
        return self._ledger.children(limit)

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
        ``on_step`` answers its durable steps' requests (``child_steps``): a handler that
        sleeps or waits raises ``Suspended`` here, a step it misuses ``StepError``."""
        if self.closed:
            raise MtaskError("the process pool is closed")
        child = await self._take()
        unwatch: Callable[[], None] | None = None
        try:
            if lease is not None:
                unwatch = lease(_renewal(child.deadline))
            pipe.send(child.conn, pipe.Call(handler, dict(params), info))
            limits = RunLimits(soft_timeout, hard_timeout, cancelled, child.cancelled.set)
            reply = await exchange.reply(
                child.conn,
                child.process.sentinel,
                self.bounds.message,
                limits,
                on_output or _ignore,
                on_step or exchange.no_steps,
            )
        except BaseException as exc:
            if isinstance(exc, TimeLimitExceeded):
                self._ledger.time_limit_kills += 1  # its child is killed next
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
        while len(self._ledger.live) < count and not self.closed:
            child = await asyncio.to_thread(self._start_child)
            self._ledger.idle.append(child)
            self._ledger.gauges()

    async def close(self) -> None:
        """Retire idle children and kill busy ones; wait until every child is reaped."""
        self.closed = True
        await asyncio.gather(*(self._kill(c) for c in self._ledger.close()))
        await asyncio.to_thread(self._ledger.reaper.close)

    # -- children -------------------------------------------------------------------------------

    async def _take(self) -> Child:
        ledger = self._ledger
        while ledger.idle:
            child = ledger.idle.pop()
            if child.process.is_alive():
                ledger.mark_busy(child)
                return child
            ledger.forget(child)
        child = await asyncio.to_thread(self._start_child)
        ledger.mark_busy(child)
        return child

    def _start_child(self) -> Child:
        child = Child.start(self._mp, self.bounds)
        self._ledger.add(child)
        return child

    # -- after a run ----------------------------------------------------------------------------

    def _settle(self, child: Child, reply: pipe.Reply | pipe.Stopped | None) -> Any:
        """Keep or recycle a child that replied, and return its run's result or raise what
        the run ended with (``pipe.Reply.result``); forget one that did not."""
        if not isinstance(reply, pipe.Reply):
            raise self._ended(child, reply)
        child.tasks += 1
        child.rss = reply.rss
        self._ledger.mark_idle(child)
        self._keep_or_recycle(child, reply)
        return reply.result()

    def _keep_or_recycle(self, child: Child, reply: pipe.Reply) -> None:
        """Recycle a child out of memory, at ``max_tasks_per_child`` runs, or past either
        memory limit (past the hard one its next run would be killed at once); forget one the
        memory watch killed just after it replied; keep the others idle."""
        recycle = reply.kind is pipe.ReplyKind.MEMORY or (
            self.max_tasks_per_child is not None and child.tasks >= self.max_tasks_per_child
        )
        limits = [n for n in (self.max_memory_per_child, self.memory_limit) if n is not None]
        if child.over_limit is not None:
            self._ledger.ended("memory_limit")
            self._ledger.forget(child)
        elif recycle or self.closed or any(reply.rss > n for n in limits):
            self._retire(child)
        else:
            self._ledger.idle.append(child)

    def _ended(self, child: Child, stopped: pipe.Stopped | None) -> MtaskError:
        """Forget a child that ended its run by dying (``stopped`` None: killed for its
        memory, or died) or by stopping itself at its lease deadline; what the run raises."""
        child.process.join(5)  # ended, or ending: the lease watch is killing it
        error = child.death(stopped, self.memory_limit)
        killpg(child.process.pid)  # what its handler started dies with it
        self._ledger.ended("died" if child.over_limit is None else "memory_limit")
        self._ledger.forget(child)
        return error

    def _retire(self, child: Child) -> None:
        """Recycle a healthy child: ask it to exit, reap it in the background."""
        self._ledger.retired(child)
        with contextlib.suppress(OSError):
            pipe.send(child.conn, pipe.Retire())

        def reap() -> None:
            child.process.join(self.term_grace + 5)
            if child.process.is_alive():
                child.process.kill()
                child.process.join()
            self._ledger.forget(child)

        threading.Thread(target=reap, name="mtask-child-reap", daemon=True).start()

    async def _kill(self, child: Child) -> None:
        """SIGTERM, then SIGKILL after ``term_grace``, to the child's whole process group;
        reap; forget."""
        pid = child.process.pid
        if pid is not None and child.process.is_alive():
            self._ledger.ended("killed")
            await child.terminate(self.term_grace)
        killpg(pid)
        self._ledger.forget(child)
        if child in self._ledger.idle:
            self._ledger.idle.remove(child)


def _renewal(deadline: Any) -> Callable[[float], None]:
    """What a run's lease watch calls, on the pinger's thread, with each new expiry: the
    child's shared deadline moves."""

    def renewed(expiry: float) -> None:
        deadline.value = expiry

    return renewed


def _ignore(batch: Batch) -> None:
    """``on_output`` for a caller that does not want the run's output."""
