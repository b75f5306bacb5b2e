"""A schedule's ticks, pure rules on its APScheduler trigger (property-tested): the first tick,
the next and the latest, which ticks a pass publishes (``plan``, under ``catch_up``), a tick's
task key, and ``overlap``'s step. The definition they read is ``schedules.definition.Schedule``;
the store operations are ``mtask.store.schedules``. No model here: a worker whose cluster has
no schedule imports no pydantic."""

from __future__ import annotations

import datetime as dt
from typing import TYPE_CHECKING, Literal, Protocol

from mtask.errors import InvalidTask

if TYPE_CHECKING:
    from apscheduler.triggers.base import BaseTrigger

Overlap = Literal["all", "skip", "buffer"]
BUFFER_RECHECK_S = 1.0
"""How often a schedule holding a buffered tick looks whether its previous task finished."""
MAX_TICKS_PER_PASS = 1000
"""The most ticks one pass publishes under ``catch_up="all"``."""


class CatchingUp(Protocol):
    """What ``plan`` reads of a schedule (``schedules.definition.Schedule`` is one)."""

    @property
    def catch_up(self) -> str: ...

    @property
    def misfire_grace_s(self) -> float: ...


def whole_ms(value: dt.datetime) -> dt.datetime:
    """``value`` in UTC to the millisecond: MongoDB keeps milliseconds, so compute with what
    will be stored."""
    value = value.astimezone(dt.UTC)
    return value.replace(microsecond=value.microsecond // 1000 * 1000)


MAX_SUB_MS_STEPS = 100
"""How many steps ``next_after`` takes that do not pass the next millisecond before it gives up
(a valid trigger takes one or two: an interval of at least 50 ms computed with floats)."""


def next_after(trigger: BaseTrigger, tick: dt.datetime) -> dt.datetime | None:
    """The first tick strictly after ``tick``; ``InvalidTask`` if the trigger does not move
    forward (it would never find one)."""
    found = trigger.get_next_fire_time(tick, tick)
    steps = 0
    while found is not None and whole_ms(found) <= tick:  # a sub-millisecond step
        steps += 1
        if steps > MAX_SUB_MS_STEPS:
            raise InvalidTask(
                f"the trigger does not move past {tick.isoformat()}", field="schedule"
            )
        found = trigger.get_next_fire_time(found, found)
    return None if found is None else whole_ms(found)


def first_tick(trigger: BaseTrigger, now: dt.datetime) -> dt.datetime | None:
    """The first tick at or after ``now``. (Asked from a millisecond before: an interval
    trigger computes with floats, and may step over a tick that falls exactly on ``now``.)"""
    found = trigger.get_next_fire_time(None, now - dt.timedelta(milliseconds=1))
    tick = None if found is None else whole_ms(found)
    while tick is not None and tick < now:
        tick = next_after(trigger, tick)
    return tick


def latest_tick(trigger: BaseTrigger, now: dt.datetime, floor: dt.datetime) -> dt.datetime | None:
    """The last tick at or before ``now`` and at or after ``floor`` (a tick), without walking
    every tick since ``floor``: look back 1 s, 2 s, 4 s, … for a window that holds one."""
    step = dt.timedelta(seconds=1)
    while True:
        start = max(floor, now - step)
        tick = first_tick(trigger, start)
        if tick is not None and tick <= now:
            while (following := next_after(trigger, tick)) is not None and following <= now:
                tick = following
            return tick
        if start == floor:
            return None
        step *= 2


def plan(
    schedule: CatchingUp, trigger: BaseTrigger, next_tick_at: dt.datetime, now: dt.datetime
) -> tuple[list[dt.datetime], dt.datetime | None]:
    """The ticks to publish now, and the schedule's next tick after them."""
    if next_tick_at > now:
        return [], next_tick_at
    if schedule.catch_up == "all":
        ticks: list[dt.datetime] = []
        tick: dt.datetime | None = next_tick_at
        while tick is not None and tick <= now and len(ticks) < MAX_TICKS_PER_PASS:
            ticks.append(tick)
            tick = next_after(trigger, tick)
        return ticks, tick
    latest = latest_tick(trigger, now, next_tick_at)
    if latest is None:  # the trigger gave no tick in the window (it has ended)
        return [], next_after(trigger, now)
    late = (now - latest).total_seconds()
    publish = schedule.catch_up == "latest" or late <= schedule.misfire_grace_s
    return ([latest] if publish else []), next_after(trigger, latest)


def tick_key(schedule_id: str, tick: dt.datetime) -> str:
    """The task key of ``schedule_id``'s tick: the same for every worker that fires it."""
    stamp = whole_ms(tick).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    return f"{schedule_id}@{stamp}"


def overlap_step(
    overlap: Overlap,
    newest: dt.datetime | None,
    buffered: dt.datetime | None,
    previous_open: bool,
) -> tuple[dt.datetime | None, dt.datetime | None, int]:
    """What a pass does under ``overlap`` (pure): the tick to publish now, the tick buffered
    after it, and how many ticks it skips; ``newest`` is this pass's newest due tick (its older
    ones are skipped by the caller), ``buffered`` the tick held from before."""
    if not previous_open:
        if buffered is None:
            return newest, None, 0
        # the buffered one goes first; a newer one would overlap it: held (buffer)
        return buffered, newest, 0
    if overlap == "skip" or buffered is not None:
        return None, buffered, int(newest is not None)
    return None, newest, 0
