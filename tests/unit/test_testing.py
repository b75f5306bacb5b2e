"""``mtask.testing``: a handler's outcome without MongoDB, as the worker would record it."""

from __future__ import annotations

import asyncio
import datetime as dt
import threading
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import BaseModel

from mtask import Fail, LeaseLost, Next, Registry, Retry, RunState, TaskContext
from mtask.errors import ConfigError
from mtask.follow.output import RecordedOutput, RunOutput
from mtask.registry import retry_delay_ms
from mtask.testing import MemorySteps, TimeSkippingEnv, arun_handler, run_handler, timeskip
from mtask.vocabulary import MAX_RETRY_DELAY_MS

registry = Registry()


class Size(BaseModel):
    width: int


@registry.task("resize")
async def resize(params: Size, ctx: TaskContext) -> dict[str, Any]:
    if params.width <= 0:
        raise Fail("width must be positive")
    if params.width > 10_000:
        raise Retry("too big for now", delay=2.5)
    return {"width": params.width, "attempt": ctx.attempt, "key": ctx.key}


@registry.task("crash")
def crash(params: dict[str, Any]) -> None:
    raise RuntimeError(f"boom on {threading.current_thread().name}")


@registry.task("order")
async def order(params: dict[str, list[str]]) -> list[Next]:
    return [Next("pack", {"item": item}) for item in params["items"]]


@registry.task("huge")
def huge(params: dict[str, Any]) -> str:
    return "x" * 2000


@registry.task("notify")
async def notify(params: dict[str, Any], ctx: TaskContext) -> None:
    await ctx.publish("email", "mail-1", {"to": params["to"]})


def test_success_carries_the_result() -> None:
    outcome = run_handler(registry, "resize", {"width": 640}, key="img-1", attempt=3)
    assert outcome.state is RunState.SUCCESS
    assert outcome.result == {"width": 640, "attempt": 3, "key": "img-1"}
    assert outcome.key == "img-1" and outcome.steps == ()


def test_fail_is_permanent_and_retry_keeps_its_delay() -> None:
    failed = run_handler(registry, "resize", {"width": 0})
    assert failed.state is RunState.FAIL and failed.permanent
    assert failed.error == "failed: width must be positive"
    retried = run_handler(registry, "resize", {"width": 20_000})
    assert retried.state is RunState.FAIL and not retried.permanent
    assert retried.retry_delay_ms == 2500


class LaterStill(Retry):
    """A subclass that sets its delay itself, past the constructor's check."""

    def __init__(self) -> None:
        super().__init__("later still")
        self.delay = float("inf")


@registry.task("far")
def far(params: dict[str, Any]) -> None:
    if params["how"] == "subclass":
        raise LaterStill()
    raise Retry("much later", delay=params["delay"])


@pytest.mark.parametrize(
    "delay", [1e12, float("inf"), float("nan"), -1, True, "5", dt.timedelta.max]
)
def test_a_retry_delay_out_of_range_fails_the_run_naming_it(delay: Any) -> None:
    """It made a date past year 9999 (OverflowError), which stopped the outcome writer and so
    the worker, and every worker that took the task over."""
    with pytest.raises(ValueError, match="Retry delay must be a number of seconds from 0 to"):
        Retry(delay=delay)
    outcome = run_handler(registry, "far", {"how": "raise", "delay": delay})
    assert outcome.state is RunState.FAIL and not outcome.permanent
    assert outcome.retry_delay_ms is None  # the task's own backoff
    assert outcome.error is not None and "Retry delay must be a number of seconds" in outcome.error


def test_a_retry_delay_changed_past_the_check_gets_the_backoff() -> None:
    outcome = run_handler(registry, "far", {"how": "subclass"})
    assert outcome.state is RunState.FAIL and outcome.retry_delay_ms is None
    assert outcome.error == (
        "retry requested: later still (Retry delay must be a number of seconds from 0 to "
        "2592000 (30 days), not inf)"
    )


@given(st.floats(0, MAX_RETRY_DELAY_MS / 1000) | st.integers(0, MAX_RETRY_DELAY_MS // 1000))
def test_a_retry_delay_in_range_is_kept(delay: float) -> None:
    assert Retry(delay=delay).delay == round(delay * 1000) / 1000
    assert 0 <= (retry_delay_ms(delay) or 0) <= MAX_RETRY_DELAY_MS


def test_invalid_params_fail_for_good_without_calling_the_handler() -> None:
    outcome = run_handler(registry, "resize", {"width": "wide"})
    assert outcome.state is RunState.FAIL and outcome.permanent
    assert outcome.error is not None and "params do not match Size" in outcome.error


def test_an_exception_is_a_retryable_failure_with_its_traceback() -> None:
    outcome = run_handler(registry, "crash")
    assert outcome.state is RunState.FAIL and not outcome.permanent
    assert outcome.error is not None and "RuntimeError: boom on mtask-run-" in outcome.error
    assert "Traceback" in outcome.error  # a plain def ran on a thread of its own, as in a worker


def test_next_steps_are_built_as_the_worker_would_publish_them() -> None:
    outcome = run_handler(registry, "order", {"items": ["a", "b"]}, key="order-1")
    assert outcome.state is RunState.SUCCESS
    assert outcome.result == ["order-1/pack.0", "order-1/pack.1"]
    assert [s["key"] for s in outcome.steps] == outcome.result
    assert [s["params"] for s in outcome.steps] == [{"item": "a"}, {"item": "b"}]


def test_a_result_over_the_limit_fails_for_good() -> None:
    outcome = run_handler(registry, "huge", max_result_bytes=1000)
    assert outcome.state is RunState.FAIL and outcome.permanent
    assert outcome.error is not None and "the limit is 1000" in outcome.error


async def test_inside_an_event_loop_and_with_a_publisher() -> None:
    published: list[tuple[Any, ...]] = []

    async def publisher(*args: Any, **kwargs: Any) -> None:
        published.append(args)

    outcome = await arun_handler(registry, "notify", {"to": "a@b.c"}, publisher=publisher)
    assert outcome.state is RunState.SUCCESS
    assert published == [("email", "mail-1", {"to": "a@b.c"})]
    with pytest.raises(RuntimeError, match="await arun_handler"):
        run_handler(registry, "notify", {"to": "x"})


def test_an_unknown_name_raises() -> None:
    with pytest.raises(KeyError):
        run_handler(registry, "nope")


@registry.task("zombie")
async def zombie(params: dict[str, Any], ctx: TaskContext) -> None:
    ctx.lease_lost = True  # as the worker sets it when another run took the task over
    try:
        await ctx.publish("email", "mail-2")
    except LeaseLost:
        ctx.check_lease()  # raises again: the run stops here


def test_a_run_that_lost_its_lease_cannot_publish() -> None:
    published: list[Any] = []

    async def publisher(*args: Any) -> None:
        published.append(args)

    outcome = run_handler(registry, "zombie", publisher=publisher)
    assert published == []
    assert outcome.error is not None and "LeaseLost: run test-key:test-run" in outcome.error


def test_worker_argv_is_a_worker_command_line() -> None:
    import subprocess

    from mtask.testing import worker_argv

    argv = worker_argv(
        "workerapp:registry", "mongodb://h/?replicaSet=r", "db", "--concurrency", "3"
    )
    assert argv[1:5] == ["-m", "mtask", "worker", "run"]
    assert argv[-4:] == ["--log-level", "WARNING", "--concurrency", "3"]
    assert "--log-level" not in worker_argv("a:b", "u", "d", "--log-level", "INFO")[:-2]
    shown = subprocess.run([*argv, "--help"], capture_output=True, text=True, check=True)
    assert "--concurrency" in shown.stdout  # the interpreter and module run as a worker would


@registry.task("narrate")
def narrate(params: dict[str, Any], ctx: TaskContext) -> str:
    ctx.progress(0.5, "half")
    ctx.log.info("said", n=1)
    ctx.emit("chunk")
    return "ok"


def test_run_handler_gives_back_what_the_handler_said() -> None:
    output = RunOutput()
    outcome = run_handler(registry, "narrate", {}, output=output)
    assert outcome.state is RunState.SUCCESS
    said = RecordedOutput.of(output)
    assert said.progress == {"fraction": 0.5, "label": "half"}
    assert [(e["message"], e["fields"]) for e in said.logs] == [("said", {"n": 1})]
    assert said.chunks == ["chunk"]
    assert run_handler(registry, "narrate", {}).state is RunState.SUCCESS  # no output given


CHARGES: list[int] = []


@registry.task("approve")
def approve(params: dict[str, int], ctx: TaskContext) -> dict[str, Any]:
    charged = ctx.step_sync("charge", lambda: CHARGES.append(params["amount"]) or len(CHARGES))
    decision = ctx.wait_for_sync("approved")
    return {"charged": charged, "decision": decision}


def test_steps_and_signals_between_calls() -> None:
    steps = MemorySteps()
    first = run_handler(registry, "approve", {"amount": 5}, steps=steps)
    assert first.state is RunState.WAITING and first.wait is not None
    assert first.wait.signal == "approved"
    assert [e["name"] for e in steps.recorded] == ["charge", "wait:approved"]
    steps.signal("approved", "yes")
    second = run_handler(registry, "approve", {"amount": 5}, steps=steps, attempt=2)
    assert second.state is RunState.SUCCESS
    assert second.result == {"charged": 1, "decision": "yes"} and CHARGES == [5]  # replayed


def test_a_missing_libfaketime_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """``TimeSkippingEnv`` needs libfaketime: where there is none, a ``ConfigError`` names it
    and how to install it, before anything starts."""
    monkeypatch.delenv("MTASK_LIBFAKETIME", raising=False)
    monkeypatch.setattr(timeskip, "LIBFAKETIME_GLOBS", ("/nonexistent/libfaketime.so.1",))
    with pytest.raises(ConfigError, match=r"libfaketime is not installed.*apt-get install"):
        asyncio.run(TimeSkippingEnv(Registry()).__aenter__())
    monkeypatch.setenv("MTASK_LIBFAKETIME", "/nonexistent/lib.so")
    with pytest.raises(ConfigError, match="MTASK_LIBFAKETIME=/nonexistent/lib.so is not a file"):
        timeskip.find_libfaketime()
