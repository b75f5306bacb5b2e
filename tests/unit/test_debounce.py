"""Debounce's pure parts: its bounds, the window's key and first document, and the
update that collapses a publish into a window (the last params win, due by the quiet period
but never after the window's maximum)."""

from __future__ import annotations

import datetime as dt

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mtask.errors import InvalidTask
from mtask.models import NewTask
from mtask.store.debounce import (
    MAX_DEBOUNCED_KEY,
    Quiet,
    check_key,
    collapse_pipeline,
    open_filter,
    window_document,
    window_key,
)
from mtask.vocabulary import MAX_KEY_LENGTH

NOW = dt.datetime(2026, 11, 28, 3, 12, 17, 123000, tzinfo=dt.UTC)


@given(st.floats(0, 3600), st.floats(0, 3600))
def test_the_bounds(quiet: float, extra: float) -> None:
    q = Quiet.build(quiet, quiet + extra)
    assert q.quiet_ms == round(quiet * 1000) and q.max_ms == round((quiet + extra) * 1000)


@pytest.mark.parametrize(
    ("debounce", "most", "field"),
    [
        (-1, None, "debounce"),
        (True, None, "debounce"),
        (5, 4, "debounce_max"),
        (5, "x", "debounce_max"),
    ],
)
def test_bad_bounds(debounce: object, most: object, field: str) -> None:
    with pytest.raises(InvalidTask) as caught:
        Quiet.build(debounce, most)
    assert caught.value.field == field


def test_the_windows_key_fits() -> None:
    assert window_key("k", NOW) == "k~2026-11-28T03:12:17.123Z"
    assert len(window_key("k" * MAX_DEBOUNCED_KEY, NOW)) == MAX_KEY_LENGTH
    with pytest.raises(InvalidTask):
        check_key("k" * (MAX_DEBOUNCED_KEY + 1))


def test_a_new_window_is_due_after_the_quiet_period_or_its_maximum() -> None:
    task = NewTask.build("collect", "k", {"n": 1})
    doc = window_document(task, Quiet(5_000, 2_000), NOW)
    assert doc["_id"] == "k~2026-11-28T03:12:17.123Z"
    assert doc["next_claim_at"] == doc["available_at"] == NOW + dt.timedelta(seconds=2)
    assert doc["debounce"] == {
        "key": "k",
        "first_at": NOW,
        "last_at": NOW,
        "count": 1,
        "max_at": NOW + dt.timedelta(seconds=2),
    }


def test_the_collapse_is_fenced_to_an_unclaimed_window_and_the_last_params_win() -> None:
    assert open_filter("collect", "k") == {
        "name": "collect",
        "debounce.key": "k",
        "status": "pending",
        "attempts": 0,
    }
    first = collapse_pipeline({"n": 2}, Quiet(5_000), NOW)[0]["$set"]
    assert first["params"] == {"$literal": {"n": 2}}
    assert first["available_at"] == {"$min": [NOW + dt.timedelta(seconds=5), "$debounce.max_at"]}
    assert first["debounce.last_at"] == NOW
