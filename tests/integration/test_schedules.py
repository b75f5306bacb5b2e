"""Repeatable tasks: tick planning (property tests), the schedule documents on the real server
with an injected clock, and workers publishing each tick once."""

from __future__ import annotations

import datetime as dt
import itertools
import re
from typing import Any

import pytest
from apscheduler.triggers.interval import IntervalTrigger
from harness import T0, running_worker, wait_for
from hypothesis import given
from hypothesis import strategies as st

from mtask import TaskClient
from mtask.clock import FixedClock
from mtask.errors import InvalidTask
from mtask.models import NewTask
from mtask.registry import Registry
from mtask.schedules import Schedule, ScheduleNotFound
from mtask.schedules.ticks import first_tick, latest_tick, next_after, plan, tick_key
from mtask.store.schedules import due, fire
from mtask.vocabulary import MAX_KEY_LENGTH


def ticks_between(trigger: Any, start: dt.datetime, now: dt.datetime) -> list[dt.datetime]:
    found = []
    tick = first_tick(trigger, start)
    while tick is not None and tick <= now:
        found.append(tick)
        tick = next_after(trigger, tick)
    return found


@given(
    every_ms=st.integers(50, 7_200_000),
    down_ms=st.integers(0, 50 * 3_600_000),
    catch_up=st.sampled_from(["none", "latest", "all"]),
    grace_s=st.integers(0, 600),
)
def test_plan_follows_the_catch_up_policy(
    every_ms: int, down_ms: int, catch_up: str, grace_s: int
) -> None:
    schedule = Schedule.build(
        "s", "t", every=every_ms / 1000, catch_up=catch_up, misfire_grace_s=grace_s
    )
    trigger = schedule.trigger(T0)
    first = first_tick(trigger, T0)
    assert first == T0
    now = T0 + dt.timedelta(milliseconds=down_ms)
    ticks, following = plan(schedule, trigger, first, now)
    assert following is not None and following > (ticks[-1] if ticks else T0)
    assert all(t <= now for t in ticks) and ticks == sorted(set(ticks))
    missed = down_ms // every_ms + 1  # ticks at or before now
    if catch_up == "all":
        assert len(ticks) == min(missed, 1000)
        assert ticks[0] == T0
        if missed <= 1000:
            assert following > now
    else:
        assert following > now
        latest = T0 + dt.timedelta(milliseconds=(missed - 1) * every_ms)
        if catch_up == "latest" or (now - latest).total_seconds() <= grace_s:
            assert ticks == [latest]
        else:
            assert ticks == []


@given(
    every_ms=st.integers(50, 100_000),
    offset_ms=st.integers(0, 10**9),
    steps=st.integers(0, 50),
)
def test_a_tick_is_its_own_first_tick(every_ms: int, offset_ms: int, steps: int) -> None:
    """Interval triggers compute with floats; a tick must never be stepped over."""
    start = T0 + dt.timedelta(milliseconds=offset_ms)
    trigger = Schedule.build("s", "t", every=every_ms / 1000).trigger(start)
    tick = first_tick(trigger, start)
    assert tick == start
    for _ in range(steps):
        following = next_after(trigger, tick)
        assert following is not None
        assert (following - tick) == dt.timedelta(milliseconds=every_ms)
        assert first_tick(trigger, following) == following
        assert first_tick(trigger, tick + dt.timedelta(milliseconds=1)) == following
        tick = following


@given(minute=st.integers(0, 59), hours=st.integers(1, 24 * 40))
def test_latest_tick_agrees_with_walking_every_tick(minute: int, hours: int) -> None:
    schedule = Schedule.build("s", "t", cron=f"{minute} * * * *", timezone="Europe/Paris")
    trigger = schedule.trigger(T0)
    now = T0 + dt.timedelta(hours=hours, seconds=17)
    walked = ticks_between(trigger, T0, now)
    assert latest_tick(trigger, now, T0) == (walked[-1] if walked else None)


def test_cron_ticks_follow_the_time_zone() -> None:
    schedule = Schedule.build("s", "t", cron="0 9 * * *", timezone="Europe/Paris")
    trigger = schedule.trigger(T0)
    winter = first_tick(trigger, dt.datetime(2026, 1, 10, tzinfo=dt.UTC))
    summer = first_tick(trigger, dt.datetime(2026, 7, 10, tzinfo=dt.UTC))
    assert winter == dt.datetime(2026, 1, 10, 8, 0, tzinfo=dt.UTC)
    assert summer == dt.datetime(2026, 7, 10, 7, 0, tzinfo=dt.UTC)


def test_tick_keys() -> None:
    tick = dt.datetime(2026, 3, 1, 12, 0, 0, 123456, tzinfo=dt.UTC)
    assert tick_key("report", tick) == "report@2026-03-01T12:00:00.123Z"


def test_a_schedule_id_leaves_room_for_its_ticks() -> None:
    """An id of 488 to 512 characters was accepted, and its first tick's key (25 more) was
    refused: the schedule stopped with an error on its first tick."""
    latest = dt.datetime(9999, 12, 31, 23, 59, 59, 999000, tzinfo=dt.UTC)
    longest = "a" * (MAX_KEY_LENGTH - len(tick_key("", latest)))  # 487
    NewTask.build("t", tick_key(Schedule.build(longest, "t", every=60).id, latest))
    for length in (len(longest) + 1, MAX_KEY_LENGTH):
        with pytest.raises(InvalidTask, match=f"^id: is {length} characters; at most 487"):
            Schedule.build("a" * length, "t", every=60)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "schedule: give exactly one of cron or every"),
        ({"cron": "* * * * *", "every": 5}, "schedule: give exactly one of cron or every"),
        ({"cron": "61 * * * *"}, "cron: '61 * * * *' is not a cron expression"),
        ({"every": 0}, "every: must be from 0.05 seconds to a year"),
        ({"every": 5, "timezone": "Mars/Olympus"}, "timezone: unknown time zone 'Mars/Olympus'"),
        ({"every": 5, "catch_up": "some"}, "catch_up: must be one of none, latest, all"),
        ({"every": 5, "options": {"priority": "x"}}, "options.priority: Input should be"),
        ({"every": 5, "options": {"run_at": T0}}, "options.run_at: run_at cannot be set"),
        ({"every": 5, "params": [1]}, "params: must be a mapping"),
    ],
)
def test_bad_schedules_are_refused_and_nothing_is_written(
    client: TaskClient, kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(InvalidTask, match="^" + re.escape(message)):
        client.add_schedule("s", "t", **kwargs)
    with pytest.raises(InvalidTask, match="^id: must not contain '@'"):
        client.add_schedule("a@b", "t", every=5)
    assert client.schedules() == []


def test_concurrent_schedulers_publish_each_tick_once(tc: TaskClient, clock: FixedClock) -> None:
    tc.add_schedule("beat", "t", every=60, params={"x": 1})
    clock.advance(seconds=150)  # ticks at T0, +60 s, +120 s; catch_up "latest": only +120 s
    now = clock.now()
    snapshot = tc._run(due(now))
    # three workers fire from the same snapshot: one task, one advance
    created = [tc._run(fire(doc, now)) for doc in snapshot * 3]
    assert created == [1, 0, 0]
    [task] = tc.list()
    assert task.key == tick_key("beat", T0 + dt.timedelta(seconds=120)) and task.params == {"x": 1}
    [doc] = tc.schedules()
    assert doc["next_tick_at"] == T0 + dt.timedelta(seconds=180) and doc["last_key"] == task.key
    assert tc._run(due(now)) == []


def test_a_scheduler_that_fires_a_stale_read_late_never_moves_the_schedule_back(
    tc: TaskClient, clock: FixedClock
) -> None:
    """Two schedulers read the same tick; one fires it, and the next tick too, before the other
    (stalled since its read) fires what it read: that finds the tick's task there and its
    advance, compared against the tick it read, changes nothing: no tick is published again."""
    tc.add_schedule("beat", "t", every=60)
    clock.advance(seconds=90)  # the tick at +60 s is due
    stalled_at = clock.now()
    [stale] = tc._run(due(stalled_at))
    assert tc._run(fire(stale, stalled_at)) == 1  # the other scheduler fires it...
    clock.advance(seconds=40)
    [fresh] = tc._run(due(clock.now()))
    assert tc._run(fire(fresh, clock.now())) == 1  # ...and the tick at +120 s
    assert tc._run(fire(stale, stalled_at)) == 0  # the stalled one fires what it read
    [doc] = tc.schedules()
    assert doc["next_tick_at"] == T0 + dt.timedelta(seconds=180)  # not back at +120 s
    assert doc["last_key"] == tick_key("beat", T0 + dt.timedelta(seconds=120))
    assert sorted(t.key for t in tc.list()) == [
        tick_key("beat", T0 + dt.timedelta(seconds=s)) for s in (60, 120)
    ]


@pytest.mark.parametrize(("catch_up", "expected"), [("all", 11), ("latest", 1), ("none", 0)])
def test_missed_ticks_follow_the_policy(
    tc: TaskClient, clock: FixedClock, catch_up: str, expected: int
) -> None:
    tc.add_schedule("beat", "t", every=60, catch_up=catch_up, misfire_grace_s=10)
    clock.advance(minutes=10, seconds=30)  # down for ten and a half minutes: 11 ticks missed
    for doc in tc._run(due(clock.now())):
        tc._run(fire(doc, clock.now()))
    assert len(tc.list()) == expected
    assert tc.schedules()[0]["next_tick_at"] == T0 + dt.timedelta(minutes=11)


def test_a_schedule_is_defined_once_and_keeps_its_pause(tc: TaskClient, clock: FixedClock) -> None:
    first = tc.add_schedule("beat", "t", every=60)
    tc.pause_schedule("beat")
    clock.advance(seconds=90)
    again = tc.add_schedule("beat", "t", every=60)  # same definition: nothing changes
    assert again["next_tick_at"] == first["next_tick_at"] and again["paused"] is True
    assert tc._run(due(clock.now())) == []  # paused
    changed = tc.add_schedule("beat", "t", every=30)  # a new definition starts afresh
    assert changed["next_tick_at"] == clock.now() and changed["paused"] is True
    assert tc.resume_schedule("beat")["paused"] is False
    assert tc.remove_schedule("beat") and not tc.remove_schedule("beat")
    with pytest.raises(ScheduleNotFound, match="no schedule 'beat'"):
        tc.pause_schedule("beat")


def test_a_schedule_edited_into_nonsense_does_not_stop_the_scheduler(
    tc: TaskClient, clock: FixedClock
) -> None:
    tc.add_schedule("bad", "t", every=60)
    tc.add_schedule("good", "t", every=60)
    tc.db["schedules"].update_one({"_id": "bad"}, {"$set": {"cron": "nonsense", "every_s": None}})
    for doc in tc._run(due(clock.now())):
        tc._run(fire(doc, clock.now()))
    bad = tc.db["schedules"].find_one({"_id": "bad"})
    assert bad is not None and bad["next_tick_at"] is None
    assert "invalid schedule: cron: 'nonsense' is not a cron expression" in bad["error"]
    assert [t.key for t in tc.list()] == [tick_key("good", T0)]


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"every_s": float("inf")}, "every: must be from 0.05 seconds to a year"),
        ({"every_s": 1e15}, "every: must be from 0.05 seconds to a year"),
        ({"every_s": -5.0}, "every: must be from 0.05 seconds to a year"),
        ({"every_s": 1e-6}, "every: must be from 0.05 seconds to a year"),
        ({"every_s": float("nan")}, "every: must be from 0.05 seconds to a year"),
        ({"every_s": None}, "schedule: give exactly one of cron or every"),
        ({"cron": "* * * * *"}, "schedule: give exactly one of cron or every"),
        ({"misfire_grace_s": float("nan")}, "misfire_grace_s: must be a number of seconds"),
        ({"misfire_grace_s": -1.0}, "misfire_grace_s: must be a number of seconds"),
        ({"options": {"run_at": T0}}, "options.run_at: run_at cannot be set"),
        ({"task": ""}, "name: must not be empty"),
    ],
)
def test_a_stored_schedule_is_held_to_what_build_accepts(
    tc: TaskClient, clock: FixedClock, edit: dict[str, Any], message: str
) -> None:
    """A hand edit that no definition could give (an interval of Infinity overflowed the
    trigger and stopped the worker; a negative one made ``next_after`` spin for ever) marks
    the schedule invalid with no next tick; the others fire."""
    tc.add_schedule("bad", "t", every=60)
    tc.add_schedule("good", "t", every=60)
    tc.db["schedules"].update_one({"_id": "bad"}, {"$set": edit})
    for doc in tc._run(due(clock.now())):
        tc._run(fire(doc, clock.now()))
    bad = tc.db["schedules"].find_one({"_id": "bad"})
    assert bad is not None and bad["next_tick_at"] is None
    assert bad["error"].startswith("invalid schedule: " + message)
    assert [t.key for t in tc.list()] == [tick_key("good", T0)]


def test_next_after_gives_up_on_a_trigger_that_does_not_move_forward() -> None:
    """A trigger stepping back (or by less than a millisecond for ever) ends the search with
    an error instead of spinning the event loop."""
    backwards = IntervalTrigger(seconds=-5, start_date=T0, timezone=dt.UTC)
    with pytest.raises(InvalidTask, match="^schedule: the trigger does not move past"):
        next_after(backwards, T0)
    with pytest.raises(InvalidTask, match="^schedule: the trigger does not move past"):
        first_tick(backwards, T0 + dt.timedelta(minutes=1))


async def test_a_schedule_edited_to_an_endless_interval_does_not_stop_the_worker(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    registry = Registry()

    @registry.task("beat")
    async def beat(params: dict[str, Any], ctx: Any) -> None:
        return None

    async with running_worker(registry, mongo_uri, db_name) as (worker, _):
        client.add_schedule("s1", "beat", every=3600)
        past = client.schedules()[0]["start"] - dt.timedelta(hours=2)
        client.db["schedules"].update_one(
            {"_id": "s1"}, {"$set": {"every_s": float("inf"), "next_tick_at": past}}
        )
        await wait_for(lambda: client.schedules()[0]["error"])
        client.publish("beat", "after-edit")
        await wait_for(lambda: client.get("after-edit").status == "succeeded")
        assert worker._crash is None
    [doc] = client.schedules()
    assert doc["next_tick_at"] is None
    assert doc["error"].startswith("invalid schedule: every: must be from 0.05 seconds")


async def test_workers_publish_every_tick_once(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    registry = Registry()
    seen: list[str] = []

    @registry.task("beat")
    async def beat(params: dict[str, Any], ctx: Any) -> None:
        seen.append(ctx.key)

    # catch_up "all": a tick the schedulers come to late (a busy machine) is published too,
    # so that "none skipped" is the promise itself, not how fast the machine is
    registry.schedule("beat", every=0.2, params={"n": 1}, catch_up="all")
    async with (
        running_worker(registry, mongo_uri, db_name) as _,
        running_worker(registry, mongo_uri, db_name) as _,
    ):
        await wait_for(lambda: len(seen) >= 6, timeout=30)
    ticks = sorted(dt.datetime.fromisoformat(k.split("@")[1]) for k in set(seen))
    assert len(seen) == len(set(seen))  # each tick ran once
    steps = {(b - a).total_seconds() for a, b in itertools.pairwise(ticks)}
    assert steps == {0.2}  # consecutive ticks, none skipped while the workers ran
    [doc] = client.schedules()
    assert doc["task"] == "beat" and doc["error"] is None
