"""``mtask.Snooze``: its delay's bounds, the outcome a handler's snooze becomes (no
failure counted), the write that records it (fenced by its run, the snooze counted, the task
due after the delay on the caller's server time), and how a snoozed task explains itself."""

from __future__ import annotations

import datetime as dt
import math
import pickle
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mtask import Registry, RunState, Snooze
from mtask.explain.states import Cluster, State, explain, timing
from mtask.limits.snooze import snooze_delay_ms
from mtask.models import Task
from mtask.store import Outcome
from mtask.store.outcomes import finish_update
from mtask.testing import run_handler
from mtask.vocabulary import MAX_RETRY_DELAY_MS

NOW = dt.datetime(2026, 11, 28, 3, 12, 17, tzinfo=dt.UTC)
registry = Registry()


@registry.task("busy")
def busy(params: dict[str, Any]) -> None:
    raise Snooze(dt.timedelta(seconds=params["seconds"]), "rate limited")


@given(st.floats(min_value=0, max_value=MAX_RETRY_DELAY_MS / 1000))
def test_a_delay_in_range_is_kept_in_milliseconds(seconds: float) -> None:
    assert Snooze(seconds).delay_ms == round(seconds * 1000)


@pytest.mark.parametrize(
    "bad", [-0.001, MAX_RETRY_DELAY_MS / 1000 + 1, math.nan, math.inf, True, "5", None]
)
def test_a_delay_out_of_range_is_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="Snooze needs a number of seconds"):
        Snooze(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        snooze_delay_ms(bad)


def test_a_snooze_crosses_a_process_boundary_as_itself() -> None:
    back = pickle.loads(pickle.dumps(Snooze(2.5, "busy")))  # the pool's reply (ReplyKind.RAISE)
    assert isinstance(back, Snooze) and (back.delay_ms, str(back)) == (2500, "busy for 2.5 s")


def test_a_handlers_snooze_is_a_snoozed_outcome_not_a_failure() -> None:
    outcome = run_handler(registry, "busy", {"seconds": 30})
    assert outcome.state is RunState.SNOOZED and not outcome.permanent
    assert (outcome.retry_delay_ms, outcome.error) == (30_000, "rate limited for 30 s")


def test_the_write_is_fenced_counts_the_snooze_and_spends_no_retry() -> None:
    outcome = Outcome("k", "r1", RunState.SNOOZED, error="busy for 30 s", retry_delay_ms=30_000)
    query, stages = finish_update(outcome, NOW)
    assert query["_id"] == "k" and query["runs"]["$elemMatch"] == {
        "run_id": "r1",
        "state": "RUNNING",
    }
    first = stages[0]["$set"]
    assert first["snoozes"] == {"$add": [{"$ifNull": ["$snoozes", 0]}, 1]}
    assert first["available_at"] == NOW + dt.timedelta(seconds=30)
    assert "failures" not in first and "failed_permanently" not in first
    assert stages[1] == {
        "$set": {
            "available_at": {
                "$min": [
                    "$available_at",
                    {
                        "$cond": [
                            {"$eq": [{"$type": "$options.deadline"}, "date"]},
                            "$options.deadline",
                            "$available_at",
                        ]
                    },
                ]
            }
        }
    }


def _snoozed(times: int) -> Task:
    later = NOW + dt.timedelta(minutes=12)
    runs = [
        {
            "run_id": f"r{n}",
            "worker_id": "w1",
            "state": "SNOOZED",
            "claimed_at": NOW - dt.timedelta(seconds=30),
            "finished_at": NOW - dt.timedelta(seconds=21),
            "error": "upstream busy for 720 s",
        }
        for n in range(times)
    ]
    return Task.from_document(
        {
            "_id": "k",
            "name": "add",
            "params": {},
            "options": {"max_retries": 0},
            "status": "pending",
            "next_claim_at": later,
            "available_at": later,
            "attempts": times,
            "successes": 0,
            "failures": 1,
            "runs": runs,
            "snoozes": times,
            "created_at": NOW,
            "updated_at": NOW,
        }
    )


def test_a_snoozed_task_says_until_when_why_and_how_often() -> None:
    task = _snoozed(2)
    said = explain(task, Cluster(NOW))
    assert (said.state, said.why) == (State.WAITING, "snoozed")
    assert said.reason == (
        "snoozed until 2026-11-28 03:24:17 (in 12 min) (upstream busy for 720 s); snoozed 2 "
        "times, no retry spent"
    )
    assert timing(task, said) == ("wakes", NOW + dt.timedelta(minutes=12))
    assert "snoozed 1 time," in explain(_snoozed(1), Cluster(NOW)).reason
