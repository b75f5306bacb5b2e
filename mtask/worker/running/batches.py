"""The worker's side of batch handlers (``mtask.limits.batches``): each run of a batch
name waits here for its batch; a batch is called once ``batch`` runs have joined it, or
``batch_timeout`` after the first did, and each run gets its own entry of the answer back.

A run stopped while it waits (cancelled, lease lost, the worker stopping) leaves its batch: its
entry is dropped and its outcome is the stopped run's, as for any run. A run stopped while its
batch is being called gets nothing back either, and anything its entry said is never written:
its outcome's write is fenced by its run, as always.

A batch's size is bounded by the worker's slots (``--concurrency``): once every slot holds a
run waiting in a batch, no other run can start to join one, so every open batch is called at
once rather than at its timeout (a worker of concurrency 10 calls a ``batch=100`` handler with
10 tasks, not once a ``batch_timeout``). Give the worker at least ``batch`` slots for full
batches.
"""

from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass, field
from typing import Any

from mtask import metrics
from mtask.limits.batches import answers
from mtask.registry import BatchItem, Handler, TaskContext
from mtask.worker.worker_events import Emitter, Event


@dataclass
class _Batch:
    handler: Handler
    items: list[tuple[BatchItem, asyncio.Future[Any]]] = field(default_factory=list)
    timer: asyncio.TimerHandle | None = None
    called: bool = False


class Batches:
    """The open batch of each batch name, and their calls."""

    def __init__(self, emit: Emitter | None = None, slots: int | None = None) -> None:
        self.emit = emit or Emitter()
        self.slots = slots
        """The worker's handler slots (its concurrency): runs waiting in batches that hold
        them all are called at once (``None``: only when full or at the timeout)."""
        self._open: dict[str, _Batch] = {}
        self._calls: set[asyncio.Task[None]] = set()

    async def call(
        self, key: str, handler: Handler, params: dict[str, Any], ctx: TaskContext
    ) -> Any:
        """This run's entry of its batch's answer: its result, or raise what it says."""
        loop = asyncio.get_running_loop()
        batch = self._open.get(handler.name)
        if batch is None:
            batch = self._open[handler.name] = _Batch(handler)
            batch.timer = loop.call_later(handler.batch_timeout, self._flush, batch)
        future: asyncio.Future[Any] = loop.create_future()
        batch.items.append((BatchItem(key, dict(params), ctx), future))
        if len(batch.items) >= (handler.batch or 1):
            self._flush(batch)
        elif self.slots is not None and self._waiting() >= self.slots:
            for waiting in list(self._open.values()):  # none of them can grow any more
                self._flush(waiting)
        return await future  # a stopped run's wait is cancelled: its entry is dropped

    def _waiting(self) -> int:
        """The runs waiting in open batches (a stopped one has left its slot)."""
        return sum(not fut.done() for b in self._open.values() for _, fut in b.items)

    def _flush(self, batch: _Batch) -> None:
        if batch.called:
            return
        batch.called = True
        if batch.timer is not None:
            batch.timer.cancel()
        if self._open.get(batch.handler.name) is batch:
            del self._open[batch.handler.name]
        live = [(item, fut) for item, fut in batch.items if not fut.done()]
        if not live:
            return
        task = asyncio.create_task(
            self._call(batch.handler, live), name=f"mtask-batch-{batch.handler.name}"
        )
        self._calls.add(task)
        task.add_done_callback(self._calls.discard)

    async def _call(
        self, handler: Handler, live: list[tuple[BatchItem, asyncio.Future[Any]]]
    ) -> None:
        items = [item for item, _ in live]
        self.emit(Event.BATCH, name=handler.name, size=len(items))
        metrics.by_name(metrics.BATCH_SIZE, handler.name).observe(len(items))
        try:
            if handler.is_async:
                returned = await handler.fn(items)
            else:
                loop = asyncio.get_running_loop()
                returned = await loop.run_in_executor(None, functools.partial(handler.fn, items))
            entries = answers(returned, len(items))
        except asyncio.CancelledError:
            for _, fut in live:
                fut.cancel()
            raise
        except Exception as exc:  # noqa: BLE001 - the call's error is each task's failure
            _fail_all(live, exc)
            return
        for (_, fut), entry in zip(live, entries, strict=True):
            if fut.done():  # stopped while the batch ran: nothing of it is written
                continue
            if isinstance(entry, Exception):
                fut.set_exception(entry)
            elif isinstance(entry, BaseException):  # never a stop: the task's failure
                fut.set_exception(RuntimeError(f"the batch handler answered {entry!r}"))
            else:
                fut.set_result(entry)


def _fail_all(live: list[tuple[BatchItem, asyncio.Future[Any]]], exc: Exception) -> None:
    for _, fut in live:
        if not fut.done():
            fut.set_exception(exc)
