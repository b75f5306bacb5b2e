"""When a subscriber reads its relay's lease, without MongoDB (``scripted``): at a look unless a
frame came within ``LATE_AFTER``, and a late relay again just after it would go stale
(``subscription.look_after``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, cast

import pytest
from hypothesis import given
from hypothesis import strategies as st
from scripted import AsyncScriptedDriver, Step

from mtask.driver import AsyncDriver
from mtask.worker.finding.shared.lease import RENEW_EVERY
from mtask.worker.finding.shared.subscription import (
    LATE_AFTER,
    LOOK_EVERY,
    LOOK_MARGIN,
    STALE_AFTER,
    InboxSubscription,
    RelaySilent,
    look_after,
)


def left_at(last_renewal: float, first_look: float, next_look: Callable[[float], float]) -> float:
    """When a subscriber leaves a relay that died right after renewing at ``last_renewal``
    (seconds before its death at 0), looking first at ``first_look`` and then as
    ``next_look(age)`` says."""
    at = first_look
    for _ in range(100):
        age = at - last_renewal
        if age >= STALE_AFTER:
            return at
        at += next_look(age)
    raise AssertionError("never left")


@given(st.floats(min_value=0, max_value=RENEW_EVERY + 0.4))
def test_a_relay_that_renews_on_time_is_looked_at_every_look_every(ago: float) -> None:
    assert look_after(ago) == LOOK_EVERY  # an idle subscriber asks no more than before


@given(st.floats(min_value=LATE_AFTER, max_value=STALE_AFTER, exclude_max=True))
def test_a_late_relay_is_looked_at_again_just_after_it_would_go_stale(ago: float) -> None:
    wait = look_after(ago)
    assert 0 < wait <= LOOK_EVERY
    assert ago + wait >= STALE_AFTER  # if it renews no more, the next look leaves it
    assert ago + wait <= STALE_AFTER + LOOK_MARGIN


@given(
    st.floats(min_value=-RENEW_EVERY, max_value=0),
    st.floats(min_value=0, max_value=LOOK_EVERY, exclude_max=True),
)
def test_a_dead_relay_is_left_sooner_and_never_later(
    last_renewal: float, first_look: float
) -> None:
    now = left_at(last_renewal, first_look, look_after)
    before = left_at(last_renewal, first_look, lambda ago: LOOK_EVERY)
    assert now <= before
    assert now - last_renewal >= STALE_AFTER  # never left while its lease is still fresh
    assert now - last_renewal <= LATE_AFTER + LOOK_EVERY  # 7 s, against 9.5 s before
    assert before - last_renewal <= STALE_AFTER + LOOK_EVERY


class _Database(dict[str, Any]):
    def __missing__(self, name: str) -> Any:
        return SimpleNamespace(with_options=lambda **_: SimpleNamespace())


async def test_a_look_reads_the_lease_unless_a_frame_came_within_late_after() -> None:
    script = AsyncScriptedDriver()
    tasks = SimpleNamespace(name="tasks", database=_Database())
    script.collections = {"tasks": tasks, "inboxes": tasks}
    sub = InboxSubscription(cast(AsyncDriver, script), "r/1", "w/1", on_look=lambda: None)
    sub.heard_at = time.monotonic()  # a frame just now: it is alive
    assert await sub._lease_read() is None
    assert script.calls == []
    # a frame long enough ago for a renewal to have been missed since (before, any frame since
    # the last look skipped the read: a relay killed just after its hello was read 9 s later)
    sub.heard_at = time.monotonic() - LATE_AFTER
    script.expect(Step("find", [{"ago": 4_000}], collection="relays"))
    assert await sub._lease_read() == 4.0
    script.expect(Step("find", [{"ago": 5_000}], collection="relays"))
    with pytest.raises(RelaySilent):
        await sub._lease_read()  # stale
    script.expect(Step("find", [], collection="relays"))
    with pytest.raises(RelaySilent):
        await sub._lease_read()  # another's, or run out
    assert script.done
