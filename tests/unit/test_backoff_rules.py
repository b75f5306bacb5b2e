"""``BackOff``, its pure parts: what it accepts, what it holds, and how a hold reads
in a document of any shape."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mtask import BackOff
from mtask.errors import InvalidTask
from mtask.limits import rules as limits
from mtask.limits.holds import held_until, target
from mtask.limits.slots import Request, decide

NOW = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"seconds": 5},  # holds nothing
        {"seconds": 5, "group": True, "name": True},
        {"seconds": 0, "group": True},
        {"seconds": -1, "group": True},
        {"seconds": float("nan"), "group": True},
        {"seconds": 86_401, "group": True},
        {"seconds": True, "group": True},
        {"seconds": "5", "group": True},
    ],
)
def test_a_back_off_holds_one_thing_for_a_day_at_most(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        BackOff(**kwargs)


def test_what_a_back_off_holds() -> None:
    assert target(BackOff(5, group=True), "n", "acme") == ("n", "acme")
    assert target(BackOff(5, name=True), "n", "acme") == ("n", None)
    assert target(BackOff(5, resource="openai"), "n", None) == (
        limits.resource_slot("openai"),
        None,
    )
    with pytest.raises(InvalidTask):
        target(BackOff(5, group=True), "n", None)  # a task with no group has none to hold
    with pytest.raises(InvalidTask):
        BackOff(5, resource="a\x00b")


@given(
    st.fixed_dictionaries(
        {},
        optional={
            "held_until": st.none() | st.integers() | st.just(NOW + dt.timedelta(seconds=3)),
            "group_holds": st.none()
            | st.text()
            | st.lists(
                st.fixed_dictionaries(
                    {},
                    optional={
                        "group": st.sampled_from(["g", "h", 1]),
                        "until": st.sampled_from(
                            [NOW - dt.timedelta(seconds=1), NOW + dt.timedelta(seconds=2), "x"]
                        ),
                    },
                )
                | st.integers(),
                max_size=4,
            ),
        },
    ),
    st.sampled_from([None, "g", "h"]),
)
def test_a_hold_of_any_shape_reads_as_a_date_after_now_or_none(
    doc: dict[str, Any], group: str | None
) -> None:
    until = held_until(doc, group, NOW)
    assert until is None or until > NOW
    after = limits.retry_at(doc, NOW, group)  # the blocked key's wait: never before the hold
    assert until is None or after >= until
    assert isinstance(limits.has_holds(doc), bool)


def test_a_take_refused_by_a_hold_waits_until_it_ends() -> None:
    doc = {
        "_id": "n",
        "holders": [],
        "group_holds": [{"group": "g", "until": NOW + dt.timedelta(seconds=30)}],
    }
    (taken,) = decide([Request("n", "r1", "k1", 1000, group="g")], {"n": doc}, NOW)
    assert not taken.taken and taken.retry_at is not None
    assert taken.retry_at >= NOW + dt.timedelta(seconds=30)
