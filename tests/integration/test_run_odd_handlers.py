"""Handlers that end in odd ways, on the real server: each ends its own run, never the worker
nor another run."""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import pytest
from harness import Events, running_worker, wait_for

from mtask import TaskClient, Worker
from mtask.registry import Fail, Registry, Retry, TaskContext

registry = Registry()


class Abort(BaseException):
    """A handler's own exception class that is not an ``Exception``."""


@registry.task("exit_async")
async def exit_async(params: dict[str, Any]) -> None:
    sys.exit(3)  # as argparse does on an argument it refuses


@registry.task("exit_thread")
def exit_thread(params: dict[str, Any]) -> None:
    sys.exit(3)


@registry.task("exit_limited", time_limit=60)
async def exit_limited(params: dict[str, Any]) -> None:
    sys.exit(3)


@registry.task("exit_limited_thread", soft_time_limit=30, time_limit=60)
def exit_limited_thread(params: dict[str, Any]) -> None:
    sys.exit(3)


@registry.task("exit_transactional", transactional=True)
async def exit_transactional(params: dict[str, Any], ctx: TaskContext) -> None:
    sys.exit(3)


@registry.task("interrupt_thread")
def interrupt_thread(params: dict[str, Any]) -> None:
    raise KeyboardInterrupt  # on a handler's thread: its own, never a Ctrl-C


@registry.task("cancelled_thread")
def cancelled_thread(params: dict[str, Any]) -> None:
    raise asyncio.CancelledError  # on a handler's thread: its own, never the run's stop


@registry.task("abort")
async def abort(params: dict[str, Any]) -> None:
    raise Abort("given up")


class Unsaid(Fail):
    def __str__(self) -> str:
        raise ValueError("cannot say")


class UnsaidRetry(Retry):
    def __str__(self) -> str:
        raise ValueError("cannot say")


@registry.task("unsaid_fail")
async def unsaid_fail(params: dict[str, Any]) -> None:
    raise Unsaid()


@registry.task("unsaid_retry")
def unsaid_retry(params: dict[str, Any]) -> None:
    raise UnsaidRetry(delay=0)


@registry.task("add")
async def add(params: dict[str, int]) -> int:
    return params["a"] + params["b"]


@pytest.mark.parametrize(
    ("name", "error"),
    [
        ("exit_async", "SystemExit: 3"),
        ("exit_thread", "SystemExit: 3"),
        ("exit_limited", "SystemExit: 3"),
        ("exit_limited_thread", "SystemExit: 3"),
        ("exit_transactional", "SystemExit: 3"),
        ("interrupt_thread", "KeyboardInterrupt"),
        ("cancelled_thread", "CancelledError"),
        ("abort", "Abort: given up"),
    ],
)
async def test_an_exception_that_is_not_an_exception_fails_its_run_alone(
    mongo_uri: str, db_name: str, client: TaskClient, name: str, error: str
) -> None:
    """``SystemExit`` (``sys.exit()``, argparse's error) raised by a handler went up through
    its run's task to the event loop (asyncio hands it on) and ended the worker, stranding
    every run in flight; any other ``BaseException`` ended the run's task with no outcome, its
    task RUNNING until its lease ran out (a ``CancelledError`` from a thread's handler was taken
    for the run's stop). Each is now the run's FAIL, with its traceback."""
    client.publish(name, "odd", options={"max_retries": 0})
    async with running_worker(registry, mongo_uri, db_name, concurrency=2) as (worker, events):
        await events.wait("recorded", key="odd")
        client.publish("add", "after", {"a": 1, "b": 2})
        await events.wait("recorded", key="after")
        assert worker.state == "running"
    odd, after = client.get("odd"), client.get("after")
    assert odd is not None and odd.status == "failed" and odd.error is not None
    assert error in odd.error
    assert after is not None and after.status == "succeeded" and after.result == 3


@pytest.mark.parametrize(
    ("name", "error", "attempts"),
    [("unsaid_fail", "failed: <exception str() failed>", 1),
     ("unsaid_retry", "retry requested: <exception str() failed>", 2)],
)  # fmt: skip
async def test_a_fail_or_retry_whose_str_raises_is_recorded(
    mongo_uri: str, db_name: str, client: TaskClient, name: str, error: str, attempts: int
) -> None:
    """A ``Fail`` or ``Retry`` whose ``__str__`` raises left its run with no outcome (the
    error went up out of the outcome's making and ended the run's task), its task RUNNING
    until its lease ran out and then run again, each time. It is recorded as what it is."""
    client.publish(name, "odd", options={"max_retries": 1, "retry_delay_ms": 10})
    async with running_worker(registry, mongo_uri, db_name) as (_, events):
        await events.wait("recorded", key="odd", count=attempts)
    odd = client.get("odd")
    assert odd is not None and odd.status == "failed" and odd.attempts == attempts
    assert odd.error == error


@registry.task("deaf")
async def deaf(params: dict[str, Any]) -> str:
    try:
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        return "went on"  # ignores its stop
    return "slept"


async def test_a_handler_that_ignores_its_stop_records_nothing_once_its_lease_ran_out(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    """The run's lease ran out by the worker's own clock (its pings stopped getting through:
    here they are never sent), so it is stopped and must record nothing: another worker may
    take its task over. Its handler swallowed the cancellation and returned; that SUCCESS was
    recorded anyway, after the lease had run out."""
    async with running_worker(registry, mongo_uri, db_name) as (worker, events):
        worker.parts.pinger._ping = lambda lease: None  # type: ignore[method-assign]
        client.publish("deaf", "d", options={"worker_timeout_ms": 1000, "ping_interval_ms": 100})
        await events.wait("stopping_run", key="d", reason="lost")
        await wait_for(lambda: worker.in_flight == 0)
        await wait_for(lambda: worker.parts.recorder.unwritten == 0)
        assert not events.matching("recorded", key="d")
    task = client.get("d")
    assert task is not None and task.status == "running"
    assert [r.state.value for r in task.runs] == ["RUNNING"]


CALLED: list[str] = []


@registry.task("noted")
async def noted(params: dict[str, Any], ctx: TaskContext) -> str:
    CALLED.append(ctx.run_id)
    return "done"


@pytest.mark.parametrize("prefetch", [0, 2])  # no slot to wait for; a slot waited for
async def test_a_run_whose_lease_ran_out_before_its_handler_began_never_calls_it(
    mongo_uri: str, db_name: str, client: TaskClient, prefetch: int
) -> None:
    """The worker froze between sending its claim and starting the run (here: its claim is
    dated a minute back, as a SIGSTOP right after the send leaves it): by its own clock the
    run's lease, and any limit's place its claim took, has run out, so another worker may hold
    them. Its handler is not called, and nothing is recorded; the task is taken over once its
    lease ran out on the server's clock, and its handler runs once, there."""
    CALLED.clear()
    async with running_worker(registry, mongo_uri, db_name, prefetch=prefetch) as (worker, events):
        executor = worker.parts.executor
        start = executor.start
        executor.start = lambda doc, sent, *held: start(doc, sent - 60, *held)  # type: ignore[method-assign]
        client.publish("noted", "late", options={"worker_timeout_ms": 1000, "retry_delay_ms": 0})
        await events.wait("stopping_run", key="late", reason="lost")
        await wait_for(lambda: worker.in_flight == 0)
        await wait_for(lambda: worker.parts.recorder.unwritten == 0)
        assert not events.matching("recorded", key="late")
        assert CALLED == []
        first = client.get("late")
        assert first is not None and [r.state.value for r in first.runs] == ["RUNNING"]
    async with running_worker(registry, mongo_uri, db_name) as (_, events):
        await events.wait("recorded", key="late", timeout=60)
    task = client.get("late")
    assert task is not None and task.status == "succeeded"
    assert [r.state.value for r in task.runs] == ["TIMEOUT", "SUCCESS"]
    assert [task.runs[1].run_id] == CALLED


@registry.task("deep")
async def deep(params: dict[str, int]) -> Any:
    result: Any = "bottom"
    for _ in range(params["levels"]):
        result = [result]
    return result


@pytest.mark.parametrize("concurrency", [1, 2])  # the plain update, the pipeline
async def test_a_result_nested_too_deep_to_store_fails_its_run(
    mongo_uri: str, db_name: str, client: TaskClient, concurrency: int
) -> None:
    """A result BSON can encode but MongoDB will not store (nested past what a document may
    hold) had its SUCCESS refused by the server and dropped: the task stayed RUNNING until its
    lease ran out, then ran again, each time. It is now the run's FAIL, for good, naming the
    problem, as any result that cannot be stored is; one just within the limit is stored."""
    options = {"max_retries": 3, "concurrency": concurrency}
    client.publish("deep", "too_deep", {"levels": 200}, options=options)
    client.publish("deep", "deep", {"levels": 97}, options=options)
    async with running_worker(registry, mongo_uri, db_name, concurrency=2) as (_, events):
        await events.wait("recorded", key="too_deep")
        await events.wait("recorded", key="deep")
    too_deep, deep = client.get("too_deep"), client.get("deep")
    assert too_deep is not None and too_deep.attempts == 1
    assert [r.state.value for r in too_deep.runs] == ["FAIL"]
    assert too_deep.error is not None and "nested more than 97 levels" in too_deep.error
    assert deep is not None and [r.state.value for r in deep.runs] == ["SUCCESS"]
    assert deep.runs[0].result is not None


async def test_an_on_event_hook_that_raises_stops_no_run_nor_the_worker(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    """A program's ``on_event`` hook that raises (on every event here) was called bare: its
    error went up out of the claim, the run or the outcome writer, which stranded runs and
    stopped the worker. It is logged, and the worker goes on."""
    events = Events()

    def hook(name: str, **data: Any) -> None:
        events(name, **data)
        raise RuntimeError("the program's hook failed")

    worker = Worker(registry, uri=mongo_uri, database=db_name, on_event=hook, concurrency=2)
    task = asyncio.create_task(worker.run())
    try:
        for i in range(3):
            client.publish("add", f"h{i}", {"a": i, "b": 1})
        for i in range(3):
            await events.wait("recorded", key=f"h{i}")
        assert worker.state == "running" and not task.done()
    finally:
        worker.stop(immediate=True)
        await asyncio.wait_for(task, 30)
    for i in range(3):
        done = client.get(f"h{i}")
        assert done is not None and done.status == "succeeded" and done.result == i + 1
