"""``worker.running.batches.Batches`` on the event loop, without MongoDB: a batch is
called once when full or at its timeout, each run gets its own entry, a run stopped while it
waits leaves the batch, and a call that fails or answers wrongly fails each task."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from mtask import BatchItem, Registry, Retry, metrics
from mtask.limits.batches import BatchAnswerError
from mtask.registry import TaskContext
from mtask.worker.running.batches import Batches

registry = Registry()
calls: list[list[str]] = []


@registry.task("full", batch=3, batch_timeout=60)
async def full(items: list[BatchItem]) -> list[Any]:
    calls.append([i.key for i in items])
    return [Retry("again") if i.params.get("retry") else i.key.upper() for i in items]


@registry.task("slow", batch=100, batch_timeout=0.05)
def slow(items: list[BatchItem]) -> list[Any]:  # a plain def: on a thread
    calls.append([i.key for i in items])
    return [len(items)] * len(items)


@registry.task("wrong", batch=2, batch_timeout=0.01)
def wrong(items: list[BatchItem]) -> list[Any]:
    return [1]


@registry.task("boom", batch=2, batch_timeout=0.01)
async def boom(items: list[BatchItem]) -> list[Any]:
    raise RuntimeError("down")


@registry.task("exits", batch=1, batch_timeout=0.01)
async def exits(items: list[BatchItem]) -> list[Any]:
    return [SystemExit(3)]


def ctx(key: str) -> TaskContext:
    return TaskContext(key=key, name="n", attempt=1, run_id=f"r-{key}", worker_id="w")


async def one(batches: Batches, name: str, key: str, params: dict[str, Any] | None = None) -> Any:
    return await batches.call(key, registry[name], params or {}, ctx(key))


async def test_a_full_batch_is_called_at_once_and_each_run_gets_its_entry() -> None:
    calls.clear()
    batches = Batches()
    got = await asyncio.gather(
        one(batches, "full", "a"),
        one(batches, "full", "b", {"retry": True}),
        one(batches, "full", "c"),
        return_exceptions=True,
    )
    assert calls == [["a", "b", "c"]]
    assert got[0] == "A" and got[2] == "C" and isinstance(got[1], Retry)


async def test_a_batch_not_full_is_called_at_its_timeout() -> None:
    calls.clear()
    batches = Batches()
    assert await asyncio.gather(one(batches, "slow", "a"), one(batches, "slow", "b")) == [2, 2]
    assert calls == [["a", "b"]]


async def test_a_run_stopped_while_it_waits_leaves_its_batch() -> None:
    calls.clear()
    batches = Batches()
    stopped = asyncio.create_task(one(batches, "slow", "gone"))
    kept = asyncio.create_task(one(batches, "slow", "kept"))
    await asyncio.sleep(0)
    stopped.cancel()
    assert await kept == 1
    assert calls == [["kept"]]
    with pytest.raises(asyncio.CancelledError):
        await stopped


async def test_a_call_that_fails_or_answers_wrongly_fails_each_task() -> None:
    batches = Batches()
    got = await asyncio.gather(
        one(batches, "wrong", "a"), one(batches, "wrong", "b"), return_exceptions=True
    )
    assert all(isinstance(g, BatchAnswerError) and "2 items, 1 entries" in str(g) for g in got)
    got = await asyncio.gather(
        one(batches, "boom", "a"), one(batches, "boom", "b"), return_exceptions=True
    )
    assert all(isinstance(g, RuntimeError) and str(g) == "down" for g in got)
    with pytest.raises(RuntimeError, match="answered SystemExit"):  # never a stop
        await one(batches, "exits", "a")


async def test_each_calls_size_is_a_metric() -> None:
    sized = metrics.by_name(metrics.BATCH_SIZE, "full")
    before = sized._sum.get()
    batches = Batches()
    await asyncio.gather(
        one(batches, "full", "a"), one(batches, "full", "b"), one(batches, "full", "c")
    )
    assert sized._sum.get() - before == 3  # one call of three


@registry.task("wide", batch=100, batch_timeout=3600)
async def wide(items: list[BatchItem]) -> list[Any]:
    calls.append([i.key for i in items])
    return [i.key for i in items]


@registry.task("other", batch=100, batch_timeout=3600)
async def other(items: list[BatchItem]) -> list[Any]:
    calls.append([i.key for i in items])
    return [i.key for i in items]


async def test_batches_holding_every_slot_are_called_at_once_not_at_their_timeout() -> None:
    """A worker of concurrency 3 cannot start a fourth run to join a batch of 100: once its
    three slots wait in batches, each open batch is called (an hour's timeout never ends)."""
    calls.clear()
    batches = Batches(slots=3)
    first = asyncio.create_task(one(batches, "wide", "a"))
    second = asyncio.create_task(one(batches, "other", "x"))
    await asyncio.sleep(0)
    assert not first.done() and not second.done() and calls == []  # 2 of 3 slots: it may grow
    async with asyncio.timeout(30):
        got = await asyncio.gather(first, second, one(batches, "wide", "b"))
    assert got == ["a", "x", "b"]
    assert sorted(calls) == [["a", "b"], ["x"]]


async def test_a_run_that_left_its_batch_gave_its_slot_back() -> None:
    calls.clear()
    batches = Batches(slots=2)
    gone = asyncio.create_task(one(batches, "wide", "gone"))
    await asyncio.sleep(0)
    gone.cancel()
    await asyncio.gather(gone, return_exceptions=True)
    kept = asyncio.create_task(one(batches, "wide", "kept"))
    await asyncio.sleep(0)
    assert not kept.done()  # one of two slots waits: the batch may still grow
    async with asyncio.timeout(30):
        assert await asyncio.gather(kept, one(batches, "wide", "more")) == ["kept", "more"]
    assert calls == [["kept", "more"]]
