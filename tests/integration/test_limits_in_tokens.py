"""A shared resource limited in tokens (docs/flow-control.md#limits-in-tokens): runs take the
resource while its window's charged tokens are below the limit, charge what they spent when
they return (``ctx.record_usage``), and the next take waits for the next window: with three
worker processes, no window (on the server's clock) is charged more than the limit plus one
run's tokens."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
from typing import Any

import pytest
import usageapp
from harness import wait_for, worker_process
from pymongo import MongoClient

from mtask import AsyncTaskClient, InvalidTask
from mtask.limits import measured

APP = "usageapp:registry"
LIMIT = 250
WINDOW_S = 1.5


def _windows(notes: list[dict[str, Any]], width_ms: int) -> dict[int, int]:
    """The most tokens each window may have been charged: a charge counts in every window its
    bracket (the server's times just before and just after it) touches."""
    spent: dict[int, int] = {}
    for note in notes:
        first, last = (int(note[f].timestamp() * 1000) // width_ms for f in ("before", "after"))
        for window in range(first, last + 1):
            spent[window] = spent.get(window, 0) + note["tokens"]
    return spent


async def test_three_workers_never_charge_a_window_past_the_limit_plus_one_run(
    aclient: AsyncTaskClient, mongo: MongoClient[dict[str, Any]], mongo_uri: str, db_name: str
) -> None:
    await aclient.set_limit(resource="llm", concurrency=1, tokens_per=(LIMIT, WINDOW_S))
    keys = [f"m{i}" for i in range(9)]
    with contextlib.ExitStack() as stack:
        for _ in range(3):
            stack.enter_context(worker_process(mongo_uri, db_name, app=APP))
        await wait_for(lambda: _registered(aclient, 3), timeout=60, every=0.2)
        for key in keys:
            await aclient.publish("metered", key, {"uri": mongo_uri, "db": db_name})
        tasks = [await asyncio.wait_for(aclient.wait(key), 60) for key in keys]
    assert all(t.status.value == "succeeded" for t in tasks), tasks
    notes = list(mongo[db_name]["charges"].find({"after": {"$type": "date"}}))
    assert len(notes) == len(keys)  # one charge per run, each bracketed by the server's times
    assert all(isinstance(n["before"], dt.datetime) for n in notes)
    spent = _windows(notes, round(WINDOW_S * 1000))
    bound = LIMIT + usageapp.METERED_TOKENS
    assert max(spent.values()) <= bound, spent
    assert len(spent) >= 3, spent  # 900 tokens at most 350 a window: spread over windows
    doc = mongo[db_name]["limits"].find_one({"_id": "\x00llm"})
    assert doc is not None and doc[measured.USED] <= bound  # its current window's count


async def _registered(aclient: AsyncTaskClient, count: int) -> bool:
    return len(await aclient.workers()) >= count


@pytest.mark.parametrize(
    ("tokens_per", "said"),
    [
        ((-1, 60), "the tokens must be an integer"),
        ((0, 60), "the tokens must be an integer"),
        ((100, 0), "the window must be a number of seconds"),
        ((100, -5), "the window must be a number of seconds"),
        ((100.5, 60), "the tokens must be an integer"),
        ((100,), "must be a pair"),
    ],
)
async def test_a_bad_limit_in_tokens_is_refused_and_nothing_written(
    aclient: AsyncTaskClient,
    mongo: MongoClient[dict[str, Any]],
    db_name: str,
    tokens_per: Any,
    said: str,
) -> None:
    with pytest.raises(InvalidTask, match=said):
        await aclient.set_limit(resource="llm", tokens_per=tokens_per)
    assert mongo[db_name]["limits"].find_one({"_id": "\x00llm"}) is None


async def test_only_a_resource_takes_a_limit_in_tokens_and_one_without_charges_nothing(
    aclient: AsyncTaskClient, mongo: MongoClient[dict[str, Any]], db_name: str
) -> None:
    with pytest.raises(InvalidTask, match="only a resource's limit takes tokens_per"):
        await aclient.set_limit("metered", concurrency=1, tokens_per=(100, 60))
    doc = await aclient.set_limit(resource="llm", concurrency=2)
    assert doc[measured.LIMIT] is None and doc[measured.WINDOW] is None
    assert measured.slots_of("metered", {"metered": ("\x00llm",)}, {"\x00llm": doc}) == ()
    doc = await aclient.set_limit(resource="llm", tokens_per=(100, 60))  # tokens alone
    assert (doc[measured.LIMIT], doc[measured.WINDOW]) == (100, 60_000)
    assert measured.slots_of("metered", {"metered": ("\x00llm",)}, {"\x00llm": doc}) == ("\x00llm",)
