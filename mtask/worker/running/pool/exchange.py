"""One run's exchange with its child, from its ``Call`` to its ``Reply`` (``pipe``): what the
child sends before it goes to ``on_output`` (its handler's output) or is answered by ``on_step``
(its durable steps' requests, answered while the run's limits are kept), and the run's time
limits (``RunLimits``): at the soft one the child's ``ctx.cancelled`` is set, at the hard one
the run ends with ``TimeLimitExceeded`` (``ProcessPool.run`` kills the child).

The worker waits on its event loop with ``add_reader`` on the pipe and on the child's process
sentinel (``Readable``), so a child that dies is seen at once, and nothing polls."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

from mtask.follow.output import Batch
from mtask.steps import StepError
from mtask.worker.running.pool import pipe
from mtask.worker.running.pool.child_steps import sendable
from mtask.worker.running.pool.errors import TimeLimitExceeded

OnStep = Callable[[pipe.StepOp, tuple[Any, ...]], Awaitable[Any]]
"""Answers a child's request about its run's durable steps (``child_steps.ParentSteps``)."""


class RunLimits:
    """A run's time limits, from now on the loop's clock: at ``soft`` seconds, or when
    ``cancelled`` is set, ``cancel`` is called once (the child's ``ctx.cancelled``); at ``hard``
    seconds the run ends."""

    def __init__(
        self,
        soft: float | None,
        hard: float | None,
        cancelled: asyncio.Event | None,
        cancel: Callable[[], None],
    ) -> None:
        self.loop = asyncio.get_running_loop()
        self.start = self.loop.time()
        self.soft, self.hard, self.cancelled, self.cancel = soft, hard, cancelled, cancel
        self.soft_sent = False

    async def until(self, ready: asyncio.Future[None]) -> None:
        """Wait for ``ready``, the next limit, or ``cancelled``, whichever comes first."""
        waiters: list[asyncio.Future[Any]] = [ready]
        stop = None
        if not self.soft_sent and self.cancelled is not None:
            stop = asyncio.ensure_future(self.cancelled.wait())
            waiters.append(stop)
        try:
            await asyncio.wait(waiters, timeout=self._left(), return_when=asyncio.FIRST_COMPLETED)
        finally:
            if stop is not None:
                stop.cancel()

    def keep(self) -> None:
        """Raise ``TimeLimitExceeded`` past the hard limit; past the soft one (or once
        ``cancelled`` is set), cancel."""
        now = self.loop.time()
        if self.hard is not None and now >= self.start + self.hard:
            raise TimeLimitExceeded(f"time limit exceeded ({self.hard:g} s)")
        if not self.soft_sent and (
            (self.soft is not None and now >= self.start + self.soft)
            or (self.cancelled is not None and self.cancelled.is_set())
        ):
            self.cancel()
            self.soft_sent = True

    def _left(self) -> float | None:
        """Seconds until the next limit; ``None`` if there is none."""
        now = self.loop.time()
        wait: float | None = None
        if self.hard is not None:
            wait = max(0.0, self.start + self.hard - now)
        if not self.soft_sent and self.soft is not None:
            left = max(0.0, self.start + self.soft - now)
            wait = left if wait is None else min(wait, left)
        return wait


async def reply(
    conn: pipe.Connection,
    sentinel: int,
    bound: int,
    limits: RunLimits,
    on_output: Callable[[Batch], None],
    on_step: OnStep,
) -> pipe.Reply | pipe.Stopped | None:
    """The child's reply (or that its lease watch stopped it), ``None`` if it died first;
    raises ``TimeLimitExceeded``, and what ``pipe.receive`` raises for a message past
    ``bound`` or one that cannot be read."""
    readable = Readable(conn.fileno(), sentinel)
    answering: set[asyncio.Future[None]] = set()
    try:
        while True:
            await limits.until(readable.future)
            if readable.future.done():
                message = pipe.receive(conn, bound)
                if isinstance(message, pipe.Output):
                    on_output(message.batch)  # then the limits, as if nothing had come
                elif isinstance(message, pipe.StepAsk):  # the child waits; the limits are kept
                    answer = asyncio.ensure_future(_answer(conn, on_step, message))
                    answering.add(answer)
                    answer.add_done_callback(answering.discard)
                else:
                    return message
                readable.close()
                readable = Readable(conn.fileno(), sentinel)
            limits.keep()
    finally:
        readable.close()
        for pending in list(answering):  # the run ended (a limit, a death): nobody asks now
            pending.cancel()


async def _answer(conn: pipe.Connection, on_step: OnStep, ask: pipe.StepAsk) -> None:
    """Answer a child's request about its steps with a value or an exception (raised there)."""
    try:
        answer = pipe.StepAnswer(await on_step(ask.op, ask.args))
    except Exception as exc:  # noqa: BLE001 - raised in the child, as itself
        answer = pipe.StepAnswer(error=sendable(exc))
    try:
        pipe.send(conn, answer)
    except (OSError, ValueError):
        return  # the child is gone, or going: its run ends anyway
    except Exception as exc:  # noqa: BLE001 - an answer that cannot be pickled
        with contextlib.suppress(OSError, ValueError):
            pipe.send(conn, pipe.StepAnswer(error=StepError(f"the answer cannot be sent: {exc!r}")))


async def no_steps(op: pipe.StepOp, args: tuple[Any, ...]) -> Any:
    """``on_step`` for a run without a journal."""
    raise StepError("this run has no journal for durable steps")


class Readable:
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


async def wait_readable(fd: int, limit: float | None) -> bool:
    """Whether ``fd`` (a process sentinel: the process ended) became readable within
    ``limit`` seconds."""
    readable = Readable(fd)
    try:
        await asyncio.wait([readable.future], timeout=limit)
        return readable.future.done() and not readable.future.cancelled()
    finally:
        readable.close()
