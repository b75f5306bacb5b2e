"""Which recorded outcomes leave their task due at once for the recording worker's own
claimer: a hint put in its queue once the write landed (the claim decides; events may come
late or not at all, and the sweep is 30 s away)."""

from __future__ import annotations

import asyncio
import datetime as dt
from typing import Any, cast

import pytest

from mtask.clock import FixedClock
from mtask.store import Outcome, RunState
from mtask.worker.running.recorder import OutcomeRecorder, Written

NOW = dt.datetime(2026, 11, 29, 12, tzinfo=dt.UTC)


class Sink:
    def __init__(self) -> None:
        self.requeued: list[tuple[str, dt.datetime]] = []

    def succeeded(self, key: str) -> None:
        return None

    def requeue_at(self, key: str, when: dt.datetime) -> None:
        self.requeued.append((key, when))


class InFlight:
    def busy(self, key: str) -> bool:
        return False

    def on_free(self) -> None:
        return None


def recorder(sink: Sink) -> OutcomeRecorder:
    return OutcomeRecorder(
        cast(Any, None),
        FixedClock(NOW),
        releases=cast(Any, None),
        sink=cast(Any, sink),
        inflight=cast(Any, InFlight()),
        emit=lambda *args, **fields: None,
        wake=asyncio.Event(),
    )


@pytest.mark.parametrize(
    ("outcome", "due"),
    [
        (Outcome("k", "r", RunState.CONTINUED), True),
        (Outcome("k", "r", RunState.RELEASED), True),  # slot lost, stopping, no longer named
        (Outcome("k", "r", RunState.RELEASED, retry_delay_ms=500), False),  # a back-off's hold
        (Outcome("k", "r", RunState.RELEASED, error="cannot decrypt"), False),  # skipped here
        (Outcome("k", "r", RunState.SUCCESS), False),
        (Outcome("k", "r", RunState.FAIL, error="x"), False),
        (Outcome("k", "r", RunState.SNOOZED, retry_delay_ms=0), False),
        (Outcome("k", "r", RunState.CANCELLED, error="cancelled"), False),
    ],
)
def test_a_landed_outcome_hints_its_task_to_the_claimer_when_due_at_once(
    outcome: Outcome, due: bool
) -> None:
    sink = Sink()
    recorder(sink).recorded([outcome], [outcome], Written(1))
    assert sink.requeued == ([("k", NOW)] if due else [])


def test_no_hint_while_a_write_of_the_batch_was_fenced_out() -> None:
    """A batch not all recorded: which of its outcomes landed is not known, so no hint."""
    sink = Sink()
    given_back = Outcome("k", "r", RunState.RELEASED)
    other = Outcome("k2", "r2", RunState.RELEASED)
    recorder(sink).recorded([given_back, other], [given_back, other], Written(1))
    assert sink.requeued == []
