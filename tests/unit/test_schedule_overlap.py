"""A schedule's overlap policy, its pure step: what a pass publishes, holds and
skips, for every combination of a new tick, a held tick and an open previous task."""

from __future__ import annotations

import datetime as dt

import pytest

from mtask.errors import InvalidTask
from mtask.schedules import Schedule
from mtask.schedules.ticks import overlap_step

T0 = dt.datetime(2026, 11, 28, 3, 0, tzinfo=dt.UTC)
T1 = T0 + dt.timedelta(minutes=1)


@pytest.mark.parametrize(
    ("overlap", "newest", "buffered", "previous_open", "expected"),
    [
        # nothing open: the newest tick goes (or the held one first, the newest then held)
        ("skip", T1, None, False, (T1, None, 0)),
        ("buffer", T1, None, False, (T1, None, 0)),
        ("buffer", T1, T0, False, (T0, T1, 0)),
        ("buffer", None, T0, False, (T0, None, 0)),
        # the previous one open: skip counts it, buffer holds one and skips the rest
        ("skip", T1, None, True, (None, None, 1)),
        ("buffer", T1, None, True, (None, T1, 0)),
        ("buffer", T1, T0, True, (None, T0, 1)),
        ("buffer", None, T0, True, (None, T0, 0)),
        ("skip", None, None, True, (None, None, 0)),
    ],
)
def test_the_step(
    overlap: str,
    newest: dt.datetime | None,
    buffered: dt.datetime | None,
    previous_open: bool,
    expected: tuple[dt.datetime | None, dt.datetime | None, int],
) -> None:
    assert overlap_step(overlap, newest, buffered, previous_open) == expected  # type: ignore[arg-type]


def test_the_default_keeps_every_schedules_definition() -> None:
    default = Schedule.build("s", "t", every=5)
    assert default.overlap == "all"
    assert default.definition() == Schedule.build("s", "t", every=5, overlap="all").definition()
    assert default.definition() != Schedule.build("s", "t", every=5, overlap="skip").definition()


def test_an_unknown_overlap_is_refused() -> None:
    with pytest.raises(InvalidTask) as caught:
        Schedule.build("s", "t", every=5, overlap="queue")
    assert caught.value.field == "overlap"
