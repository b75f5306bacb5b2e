"""What a run ends with, for every kind of exception its handler's call can end with: the
worker's ``HandlerCalls`` and ``RunOutcomes`` (no MongoDB: the forms of ``context.py`` and
``call.py`` that do nothing). The call's own failures (a child that died, a limit, a refused
reply, a transaction) are told by their own words; the handler's by ``RunOutcomes``; each is
counted and told once."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from mtask import Fail, LeaseLost, Registry, Retry, RunState, TaskContext
from mtask.errors import InvalidParams
from mtask.steps import SignalTimeout, StepError
from mtask.store import Outcome
from mtask.worker.inflight import ActiveRun
from mtask.worker.running.call import HandlerCalls, NoTransactions
from mtask.worker.running.context import NoLeases, NoOutputs
from mtask.worker.running.outcomes import RunOutcomes
from mtask.worker.running.pool.errors import (
    ChildDied,
    HandlerError,
    MemoryLimitExceeded,
    ReplyRefused,
    TimeLimitExceeded,
)
from mtask.worker.running.transactional import TransactionEnded, TransactionTooLong
from mtask.worker.stats import WorkerStats
from mtask.worker.worker_events import Emitter

RETRIED_IN_ITS_WORDS = [
    TimeLimitExceeded("time limit exceeded (2 s)"),
    ChildDied("handler process died: signal 9 (SIGKILL)"),
    MemoryLimitExceeded("the handler's process passed its memory limit"),
    HandlerError("Traceback (most recent call last): ... SystemExit: 3"),
    TransactionTooLong("the handler's transaction took more than 50 s and was aborted"),
]
FAILED_FOR_GOOD_IN_ITS_WORDS = [
    TransactionEnded(),
    ReplyRefused("the result cannot be stored: cannot encode object: {1, 2}"),
    InvalidParams("width: field required"),
]


def ended_with(exc: BaseException) -> tuple[Outcome, WorkerStats, list[tuple[str, dict[str, Any]]]]:
    """The outcome of a run whose handler raised ``exc``, the worker's counters after it and
    the events told."""
    registry = Registry()

    @registry.task("raises")
    async def raises(params: dict[str, Any], ctx: TaskContext) -> None:
        raise exc

    events: list[tuple[str, dict[str, Any]]] = []
    stats = WorkerStats()
    outcomes = RunOutcomes(
        stats, Emitter(lambda e, **data: events.append((e, data))), 1_000_000, 1_000_000
    )
    calls = HandlerCalls(
        outcomes, transactions=NoTransactions(), leases=NoLeases(), outputs=NoOutputs()
    )

    async def main() -> Outcome:
        ctx = TaskContext(key="k", name="raises", attempt=1, run_id="r1", worker_id="w")
        run = ActiveRun(key="k", name="raises", run_id="r1", ctx=ctx)
        return await calls.call(run, registry["raises"], {"params": {}})

    return asyncio.run(main()), stats, events


@pytest.mark.parametrize("exc", RETRIED_IN_ITS_WORDS, ids=lambda e: type(e).__name__)
def test_a_call_that_failed_is_retried_in_its_own_words(exc: Exception) -> None:
    outcome, stats, events = ended_with(exc)
    assert (outcome.state, outcome.permanent, outcome.error) == (RunState.FAIL, False, str(exc))
    assert (stats.retried, stats.failed) == (1, 0)
    assert events == [
        ("failed", {"key": "k", "run_id": "r1", "error": str(exc), "permanent": False})
    ]


@pytest.mark.parametrize("exc", FAILED_FOR_GOOD_IN_ITS_WORDS, ids=lambda e: type(e).__name__)
def test_a_call_that_cannot_succeed_fails_for_good_in_its_own_words(exc: Exception) -> None:
    outcome, stats, events = ended_with(exc)
    assert (outcome.state, outcome.permanent, outcome.error) == (RunState.FAIL, True, str(exc))
    assert (stats.retried, stats.failed) == (0, 1)
    assert [e for e, _ in events] == ["failed"]


@pytest.mark.parametrize(
    ("exc", "error"),
    [
        (StepError("the steps asked for differ"), "StepError: the steps asked for differ"),
        (SignalTimeout("no signal 'paid'"), "SignalTimeout: no signal 'paid'"),
        (Fail("width must be positive"), "failed: width must be positive"),
    ],
    ids=lambda v: type(v).__name__,
)
def test_what_is_the_same_on_every_run_fails_for_good(exc: Exception, error: str) -> None:
    outcome, stats, _ = ended_with(exc)
    assert (outcome.state, outcome.permanent, outcome.error) == (RunState.FAIL, True, error)
    assert (stats.retried, stats.failed) == (0, 1)


@pytest.mark.parametrize(
    "exc", [LeaseLost("run r1 of 'k' lost its lease"), ValueError("boom"), SystemExit(3)]
)
def test_any_other_exception_is_retried_with_its_traceback(exc: BaseException) -> None:
    outcome, stats, _ = ended_with(exc)
    assert outcome.state is RunState.FAIL and not outcome.permanent
    assert outcome.error is not None and outcome.error.startswith("Traceback (most recent call")
    assert outcome.error.rstrip().endswith(f"{type(exc).__name__}: {exc}".rstrip(": "))
    assert (stats.retried, stats.failed) == (1, 0)


def test_a_retry_keeps_its_delay() -> None:
    outcome, stats, _ = ended_with(Retry("later", delay=2.5))
    assert (outcome.state, outcome.permanent, outcome.retry_delay_ms) == (
        RunState.FAIL,
        False,
        2500,
    )
    assert outcome.error == "retry requested: later"
    assert stats.retried == 1
