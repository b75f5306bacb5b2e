"""``mtask logs --follow``'s line on where a task is (``cli.logs.where``), for each place a
task can be: pure, from the document."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest

from mtask.cli.logs import where
from mtask.models import Task
from mtask.steps import NEVER

T = dt.datetime(2026, 11, 28, 3, 21, 30, tzinfo=dt.UTC)


def task(**fields: Any) -> Task:
    return Task.from_document({"_id": "order-101", "name": "checkout", "params": {}, **fields})


@pytest.mark.parametrize(
    ("fields", "said"),
    [
        ({"status": "running", "attempts": 2}, "order-101 is running (run 2)"),
        (
            {
                "status": "pending",
                "attempts": 1,
                "waiting": {"until": T, "index": 1, "step": "sleep#1"},
            },
            "order-101 is sleeping until 2026-11-28 03:21:30.000 (step 2: sleep#1)",
        ),
        (
            {
                "status": "pending",
                "attempts": 1,
                "waiting": {"until": NEVER, "index": 2, "step": "wait:ok", "signal": "ok"},
            },
            "order-101 is waiting for the signal 'ok' (step 3: wait:ok), no deadline",
        ),
        (
            {
                "status": "pending",
                "attempts": 1,
                "waiting": {"until": T, "index": 0, "signal": "ok"},
            },
            "order-101 is waiting for the signal 'ok' (step 1), until 2026-11-28 03:21:30.000",
        ),
        (
            {"status": "pending", "depends_on": ["a", "b"], "waiting_on": ["b"]},
            "order-101 is waiting on b",
        ),
        (
            {
                "status": "pending",
                "attempts": 1,
                "next_claim_at": T,
                "error": "Traceback\n  x\nKeyError: 'by'",
            },
            "order-101 runs again at 2026-11-28 03:21:30.000 (run 1 failed: KeyError: 'by')",
        ),
        (
            {"status": "pending", "attempts": 0, "next_claim_at": T},
            "order-101 is pending: not claimed yet (due at 2026-11-28 03:21:30.000)",
        ),
        ({"status": "succeeded", "attempts": 1}, "order-101 succeeded"),
        ({"status": "succeeded", "attempts": 3}, "order-101 succeeded after 3 runs"),
        (
            {"status": "failed", "attempts": 4, "error": "Traceback\nRuntimeError: 503"},
            "order-101 failed after 4 runs: RuntimeError: 503",
        ),
        ({"status": "cancelled", "attempts": 0}, "order-101 cancelled"),
        (
            {"status": "invalid", "invalid_reason": "name: missing"},
            "order-101 is invalid: name: missing",
        ),
    ],
)
def test_where_a_task_is(fields: dict[str, Any], said: str) -> None:
    assert where(task(**fields)) == said
