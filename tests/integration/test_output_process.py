"""Live output from a process-isolated handler: its child sends what the handler says to the
worker, which writes it under the run's fence like any run's (docs/output.md); what the child
sends never keeps it from its reply, its time limit or its lease's kill."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import poolhandlers
import pytest
from harness import dead, running_worker
from test_pool import INFO

from mtask import Fail, TaskClient
from mtask.follow.output import Batch
from mtask.worker.running.pool.child import _ChildOutput, _Run
from mtask.worker.running.pool.errors import ChildDied, TimeLimitExceeded
from mtask.worker.running.pool.pool import ProcessPool

# -- through a worker, into MongoDB --------------------------------------------------------------


async def test_a_childs_progress_lines_and_chunks_are_written_in_order(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    async with running_worker(poolhandlers.registry, mongo_uri, db_name, pool="process") as (
        _,
        events,
    ):
        client.publish("narrate_in_child", "c", {"chunks": 50})
        await events.wait("recorded", key="c")
    task = client.get("c")
    assert task is not None and task.status == "succeeded"
    child = task.result
    assert child != os.getpid()  # it ran in a child
    assert task.progress is not None and task.progress.label == "all sent"  # the last lands
    assert task.progress.fraction == 1.0
    assert task.output_seq == 55
    counts = task.runs[-1].output
    assert counts is not None and (counts.logs, counts.chunks) == (5, 50)
    assert (counts.logs_dropped, counts.chunks_dropped) == (0, 0)
    stored: list[dict[str, Any]] = list(client.db["tasks.output"].find({"task": "c"}).sort("seq"))
    assert [d["seq"] for d in stored] == list(range(1, 56))
    assert {d["task"] for d in stored} == {"c"}
    chunks = [d["data"] for d in stored if d["kind"] == "chunk"]
    assert chunks == [{"i": i, "pid": child} for i in range(1, 51)]
    lines = [d for d in stored if d["kind"] == "log"]
    assert [(d["message"], d["fields"]["i"]) for d in lines] == [
        ("ten more", i) for i in (10, 20, 30, 40, 50)
    ]
    # each line comes right after its tenth chunk: one order for lines and chunks
    assert [d["seq"] for d in lines] == [11, 22, 33, 44, 55]
    assert all(d.get("at") is not None for d in stored)  # stamped by the worker


async def test_what_a_failing_child_said_lands_before_its_failure(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    async with running_worker(poolhandlers.registry, mongo_uri, db_name, pool="process") as (
        _,
        events,
    ):
        client.publish("narrate_then_fail", "f", {"chunks": 30}, options={"max_retries": 0})
        await events.wait("recorded", key="f")
    task = client.get("f")
    assert task is not None and task.status == "failed"
    assert task.error == "failed: said it all, then failed"
    assert task.progress is not None and (task.progress.fraction, task.progress.label) == (
        1.0,
        "chunk 29",
    )
    assert task.output_seq == 31
    counts = task.runs[-1].output
    assert counts is not None and (counts.logs, counts.chunks) == (1, 30)
    stored = list(client.db["tasks.output"].find({"task": "f"}).sort("seq"))
    assert [d["seq"] for d in stored] == list(range(1, 32))
    assert [d["data"] for d in stored[:30]] == list(range(30))
    assert (stored[30]["kind"], stored[30]["level"], stored[30]["message"]) == (
        "log",
        "error",
        "giving up",
    )


# -- the pool: output, then the outcome, under the limits ----------------------------------------


async def test_the_output_comes_before_the_outcome(pool: ProcessPool) -> None:
    batches: list[Batch] = []
    with pytest.raises(Fail, match="said it all"):
        await pool.run(
            poolhandlers.registry["narrate_then_fail"],
            {"chunks": 100},
            INFO,
            on_output=batches.append,
        )
    entries = [e for b in batches for e in b.entries]
    assert [e["data"] for e in entries[:100]] == list(range(100))
    assert entries[100]["message"] == "giving up" and len(entries) == 101
    assert all("at" not in e for e in entries)  # the worker's RunOutput stamps them
    assert [b.progress for b in batches if b.progress][-1] == {
        "fraction": 1.0,
        "label": "chunk 99",
    }
    assert [b.counts for b in batches if b.counts][-1] == {
        "logs": 1,
        "chunks": 100,
        "logs_dropped": 0,
        "chunks_dropped": 0,
    }


async def test_a_child_that_never_stops_talking_still_meets_its_time_limit(
    pool: ProcessPool,
) -> None:
    batches: list[Batch] = []
    with pytest.raises(TimeLimitExceeded):
        await pool.run(
            poolhandlers.registry["flood_in_child"],
            {"size": 1024},
            INFO,
            hard_timeout=3.0,  # room for a child's start on a loaded host: it must talk first
            on_output=batches.append,
        )
    assert batches and isinstance(batches[0].entries[0]["data"], int)  # its pid
    assert pool.state()["time_limit_kills"] == 1


async def test_a_frozen_worker_with_a_full_pipe_does_not_keep_the_child_from_its_lease_kill(
    pool: ProcessPool,
) -> None:
    """The worker stops reading (its event loop stands still in ``on_output``) while the
    child sends more than the pipe holds: the sender blocks holding the run's lock, and the
    lease watch still kills the child and its group at the deadline."""
    first: list[int] = []
    renew: list[Any] = []

    def lease(on_expiry: Any) -> Any:
        renew.append(on_expiry)
        return lambda: None

    def frozen(batch: Batch) -> None:
        if not first:
            first.append(batch.entries[0]["data"])
            # the lease runs out a second after the child first spoke (its start on a loaded
            # host takes what it takes), and no renewal ever comes
            renew[0](time.monotonic() + 1.0)
            until_dead(first[0])

    with pytest.raises(ChildDied):
        await pool.run(
            poolhandlers.registry["flood_in_child"],
            {"size": 64 * 1024},
            INFO,
            lease=lease,
            on_output=frozen,
        )
    assert first and dead(first[0])


def until_dead(pid: int) -> None:
    """Block (the event loop too: a frozen worker) until ``pid`` is dead; 10 s at most."""
    for _ in range(500):
        if dead(pid):
            return
        time.sleep(0.02)
    raise AssertionError(f"process {pid} is still alive")


def test_a_lease_watch_whose_pipe_is_full_still_kills() -> None:
    """The lease watch says why it stops only if the pipe takes it within 0.2 s: a full pipe
    to a frozen worker does not keep it from killing."""
    mp = multiprocessing.get_context("forkserver")
    ours, theirs = mp.Pipe()
    process = mp.Process(target=poolhandlers.lease_watch_with_a_full_pipe, args=(theirs,))
    process.start()
    theirs.close()
    process.join(10)
    try:
        assert process.exitcode == -signal.SIGKILL
    finally:
        if process.is_alive():
            process.kill()
        ours.close()


# -- the child's sender, in this process ---------------------------------------------------------


def received(ours: Any) -> Iterator[Any]:
    while ours.poll():
        yield ours.recv()


def test_a_run_that_says_nothing_starts_no_thread_and_sends_nothing(
    pipe_ends: tuple[Any, Any],
) -> None:
    ours, theirs = pipe_ends
    run = _Run()
    run.active = True
    output = _ChildOutput(theirs, run)
    output.close()
    assert output._thread is None and not ours.poll()


def test_everything_said_is_sent_in_order_before_close_returns(pipe_ends: tuple[Any, Any]) -> None:
    ours, theirs = pipe_ends
    run = _Run()
    run.active = True
    output = _ChildOutput(theirs, run)
    messages: list[Any] = []
    reader = threading.Thread(target=lambda: messages.extend(_until_eof(ours)))
    reader.start()  # the pipe holds less than what is said
    for i in range(1200):  # more than one take() (500 entries)
        output.output.emit(i)
        output.output.progress(i / 1200)
    output.close()
    output.output.emit("after the run")  # a thread the handler left behind: dropped
    assert output.output.take().entries == []
    theirs.close()
    reader.join()
    assert {m[0] for m in messages} == {"out"} and len(messages) >= 3
    assert [e["data"] for _, b in messages for e in b.entries] == list(range(1200))
    assert [b.progress for _, b in messages if b.progress][-1]["fraction"] == 1199 / 1200
    assert [b.counts for _, b in messages if b.counts][-1]["chunks"] == 1200


def _until_eof(conn: Any) -> Iterator[Any]:
    while True:
        try:
            yield conn.recv()
        except EOFError:
            return


def test_nothing_is_sent_once_the_lease_watch_ended_the_run(pipe_ends: tuple[Any, Any]) -> None:
    ours, theirs = pipe_ends
    run = _Run()
    run.active = True
    output = _ChildOutput(theirs, run)
    output.output.emit(1)
    run.active = False  # the lease watch took the lock and stopped the run
    output.close()
    assert list(received(ours)) == []


def test_a_pipe_that_is_gone_does_not_fail_the_run(pipe_ends: tuple[Any, Any]) -> None:
    ours, theirs = pipe_ends
    run = _Run()
    run.active = True
    output = _ChildOutput(theirs, run)
    ours.close()  # the worker is gone
    output.output.emit(1)
    output.close()  # does not raise
