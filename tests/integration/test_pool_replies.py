"""What a process-isolated run's child sends back to the worker, with real child processes:
a result too large to store is refused in the child, before the worker reads it (the worker
runs the other runs: its memory is theirs), with the outcome a thread gives; no message longer
than the pool's bound is read; a reply that cannot be unpickled in the worker, whatever it
raises there, is its run's failure."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import poolhandlers
import pytest
from harness import gone, running_worker
from test_pool import INFO, until

from mtask import Fail, TaskClient
from mtask.worker.running.pool.errors import ReplyRefused
from mtask.worker.running.pool.pipe import Bounds
from mtask.worker.running.pool.pool import ProcessPool

NO_RETRY = {"max_retries": 0}


async def test_a_result_too_large_to_store_never_reaches_the_worker(
    mongo_uri: str, db_name: str, client: TaskClient, tmp_path: Path
) -> None:
    async with running_worker(poolhandlers.registry, mongo_uri, db_name, max_result_bytes=1000) as (
        worker,
        events,
    ):
        for name in ("big_result", "big_result_in_thread"):
            marker = tmp_path / name
            client.publish(name, name, {"marker": str(marker), "size": 300_000})
            await events.wait("recorded", key=name)
        pool = worker.parts.process_pool
        assert pool is not None and pool.state()["died"] == 0 and pool.state()["killed"] == 0
    child, thread = client.get("big_result"), client.get("big_result_in_thread")
    assert child is not None and thread is not None
    assert thread.status == "failed" and thread.attempts == 1  # for good
    assert thread.error == "the result is 300029 bytes as BSON; the limit is 1000"
    assert (child.status, child.attempts, child.error) == ("failed", 1, thread.error)
    assert not (tmp_path / "big_result").exists()  # the worker never unpickled it


async def test_a_reply_whose_unpickling_raises_is_its_runs_failure(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    """A ``CancelledError`` raised by unpickling a result in the worker ended the run's task as
    if the run had been stopped, with no outcome: the task stayed RUNNING (its lease no longer
    pinged) until another worker took it over."""
    async with running_worker(poolhandlers.registry, mongo_uri, db_name) as (worker, events):
        for name in ("exits_when_loaded", "cancels_when_loaded"):
            client.publish(name, name, options=NO_RETRY)
            await events.wait("recorded", key=name)
        client.publish("double", "after", {"n": 4})
        await events.wait("recorded", key="after")
        assert worker.state == "running"
    exits, cancels = client.get("exits_when_loaded"), client.get("cancels_when_loaded")
    assert exits is not None and exits.status == "failed"
    assert exits.error is not None and exits.error.endswith("SystemExit: unpickled\n")
    assert cancels is not None and cancels.status == "failed"
    assert cancels.error is not None and "CancelledError" in cancels.error
    after = client.get("after")
    assert after is not None and after.result["value"] == 8


async def test_a_run_records_the_class_its_handler_raised_in_the_child(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    """The run's ``error_class`` is the handler's exception's, as on a thread, not the
    ``HandlerError`` that carried its traceback across."""
    async with running_worker(poolhandlers.registry, mongo_uri, db_name) as (_, events):
        for name in ("boom", "sys_exit_in_child", "sys_exit_in_thread"):
            client.publish(name, name, options=NO_RETRY)
            await events.wait("recorded", key=name)
    boom = client.get("boom")
    assert boom is not None and boom.status == "failed" and "boom in child" in (boom.error or "")
    assert [r.error_class for r in boom.runs] == ["builtins.ValueError"]
    for name in ("sys_exit_in_child", "sys_exit_in_thread"):  # a HandlerError on a thread too
        exited = client.get(name)
        assert exited is not None and exited.status == "failed"
        assert [r.error_class for r in exited.runs] == ["builtins.SystemExit"]


@pytest.fixture
async def small() -> AsyncIterator[ProcessPool]:
    """A pool whose children send at most 100 kB at once, results of 1000 bytes stored."""
    p = ProcessPool(term_grace=0.5, bounds=Bounds(1000, 100_000))
    yield p
    seen = p.pids
    await p.close()
    await until(lambda: all(gone(pid) for pid in seen))


async def run(pool: ProcessPool, name: str, params: Any = None, **kw: Any) -> Any:
    return await pool.run(poolhandlers.registry[name], params or {}, INFO, **kw)


async def test_a_message_past_the_bound_is_not_read_and_its_child_is_replaced(
    small: ProcessPool,
) -> None:
    said: list[Any] = []
    child = await run(small, "pid")
    assert await run(small, "big_chunk", {"size": 50_000}, on_output=said.append) == "said"
    with pytest.raises(ReplyRefused, match=r"a message of more than 100000 bytes; it was killed"):
        await run(small, "big_chunk", {"size": 150_000}, on_output=said.append)
    assert len(said) == 1  # the first chunk only
    await until(lambda: gone(child))
    assert await run(small, "pid") != child
    assert small.state()["killed"] == 1


async def test_replies_past_their_bounds_are_refused_in_the_child(small: ProcessPool) -> None:
    child = await run(small, "pid")
    # stored as a thread's run stores it: as BSON gives it back, without its pickled padding
    assert await run(small, "padded_result", {"pad": 200_000}) == {"a": 1}
    with pytest.raises(
        ReplyRefused, match=r"^the result cannot be stored: .*cannot encode object: {1, 2}"
    ):
        await run(small, "big_and_no_bson", {"size": 200_000})
    with pytest.raises(Fail, match="^x{50000}$"):  # not a result: up to the message bound
        await run(small, "long_fail", {"size": 50_000})
    with pytest.raises(ReplyRefused, match=r"^the handler's reply is \d+ bytes pickled"):
        await run(small, "long_fail", {"size": 150_000})
    assert await run(small, "pid") == child  # one child all along
