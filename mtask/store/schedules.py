"""Repeatable tasks' schedules in MongoDB: a schedule put, paused, removed and read, its due ticks
found, and each tick advanced by one compare-and-set on the server's clock (the rules, what a
schedule is and when it fires, are mtask.schedules)."""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from pymongo import ASCENDING, ReturnDocument
from pymongo.errors import DuplicateKeyError

from mtask import store
from mtask.driver import Call, Doc, Op
from mtask.errors import InvalidTask
from mtask.errors import ScheduleNotFound as ScheduleNotFound
from mtask.schedules.ticks import (
    BUFFER_RECHECK_S,
    first_tick,
    overlap_step,
    plan,
    tick_key,
    whole_ms,
)

if TYPE_CHECKING:
    from apscheduler.triggers.base import BaseTrigger

    from mtask.schedules.definition import Schedule


log = logging.getLogger("mtask.schedules")

INDEXES = [("paused", ASCENDING), ("next_tick_at", ASCENDING)]
"""The due schedules' index: the scheduler's read of what has come."""


def ensure_indexes() -> Op[None]:
    yield Call("create_index", (INDEXES,), {"name": "due"}, collection="schedules")


def put(schedule: Schedule, now: dt.datetime) -> Op[Doc]:
    """Create the schedule, or change its definition (its next tick is then computed afresh);
    the same definition again changes nothing. A paused schedule stays paused."""
    start = whole_ms(now)
    definition = schedule.definition()
    fields = {
        **schedule.model_dump(exclude={"id"}),
        "definition": definition,
        "start": start,
        "next_tick_at": first_tick(schedule.trigger(start), start),
        "error": None,
        "updated_at": now,
    }
    with contextlib.suppress(DuplicateKeyError):  # it exists with this very definition
        yield Call(
            "update_one",
            (
                {"_id": schedule.id, "definition": {"$ne": definition}},
                {
                    "$set": fields,
                    "$setOnInsert": {"paused": False, "created_at": now},
                    "$unset": {"buffered_tick": "", "after_buffer": ""},
                },
            ),
            {"upsert": True},
            collection="schedules",
        )
    doc: Doc = yield Call("find_one", ({"_id": schedule.id},), collection="schedules")
    return doc


def all_schedules() -> Op[list[Doc]]:
    docs: list[Doc] = yield Call(
        "find", ({},), {"sort": [("_id", ASCENDING)]}, collection="schedules"
    )
    return docs


def set_paused(schedule_id: str, paused: bool, now: dt.datetime) -> Op[Doc]:
    """Pause, or resume: a resumed schedule's missed ticks follow its ``catch_up``."""
    doc: Doc | None = yield Call(
        "find_one_and_update",
        ({"_id": schedule_id}, {"$set": {"paused": paused, "updated_at": now}}),
        {"return_document": ReturnDocument.AFTER},
        collection="schedules",
    )
    if doc is None:
        raise ScheduleNotFound(schedule_id)
    return doc


def remove(schedule_id: str) -> Op[bool]:
    result = yield Call("delete_one", ({"_id": schedule_id},), collection="schedules")
    return bool(result.deleted_count)


def due(now: dt.datetime, limit: int = 100) -> Op[list[Doc]]:
    docs: list[Doc] = yield Call(
        "find",
        ({"paused": False, "next_tick_at": {"$lte": now}},),
        {"sort": [("next_tick_at", ASCENDING)], "limit": limit},
        collection="schedules",
    )
    return docs


def next_due() -> Op[dt.datetime | None]:
    doc = yield Call(
        "find_one",
        ({"paused": False, "next_tick_at": {"$type": "date"}}, {"next_tick_at": 1}),
        {"sort": [("next_tick_at", ASCENDING)]},
        collection="schedules",
    )
    return None if doc is None else doc["next_tick_at"]


def advance(
    doc: Mapping[str, Any],
    ticks: Sequence[dt.datetime],
    following: dt.datetime | None,
    now: dt.datetime,
    error: str | None = None,
    more: Doc | None = None,
) -> Op[bool]:
    """Move the schedule on, if no other worker did (compare-and-set on ``next_tick_at``);
    ``more``: further update operators (an overlap's buffer and counts)."""
    sets: Doc = {"next_tick_at": following, "updated_at": now, "error": error}
    if ticks:
        sets["last_tick_at"] = ticks[-1]
        sets["last_key"] = tick_key(doc["_id"], ticks[-1])
    update: Doc = {**(more or {})}
    update["$set"] = {**update.get("$set", {}), **sets}
    result = yield Call(
        "update_one",
        (
            {
                "_id": doc["_id"],
                "next_tick_at": doc["next_tick_at"],
                "definition": doc.get("definition"),
            },
            update,
        ),
        collection="schedules",
    )
    return bool(result.modified_count)


def fire(doc: Mapping[str, Any], now: dt.datetime) -> Op[int]:
    """Publish the due ticks of one schedule document and advance it; returns the tasks
    created. A document that does not describe a valid schedule (edited by hand) gets an
    ``error`` and no next tick, instead of stopping the scheduler."""
    from mtask.models import NewTask
    from mtask.schedules.definition import Schedule  # the models: loaded by the first due schedule

    try:
        schedule = Schedule.read(
            {k: doc.get(k) for k in Schedule.model_fields if k in doc} | {"id": doc["_id"]}
        )
        start = doc["start"]
        trigger = schedule.trigger(start)
        if schedule.overlap != "all":
            return (yield from _fire_overlapping(doc, schedule, trigger, now))
        ticks, following = plan(schedule, trigger, doc["next_tick_at"], now)
        tasks = [
            NewTask.build(
                schedule.task, tick_key(schedule.id, t), schedule.params, schedule.options
            )
            for t in ticks
        ]
    except (InvalidTask, ValueError, TypeError, KeyError, ArithmeticError) as exc:
        log.warning("schedule %r is invalid, not firing it: %s", doc.get("_id"), exc)
        yield from advance(doc, [], None, now, error=f"invalid schedule: {exc}")
        return 0
    created: int = (yield from store.publish_many(tasks, now)) if tasks else 0
    yield from advance(doc, ticks, following, now)
    return created


def _is_open(key: object) -> Op[bool]:
    if not isinstance(key, str):
        return False
    found: Doc | None = yield Call("find_one", ({"_id": key}, {"status": 1}))
    return found is not None and found.get("status") in ("pending", "running")


def _fire_overlapping(
    doc: Mapping[str, Any], schedule: Schedule, trigger: BaseTrigger, now: dt.datetime
) -> Op[int]:
    from mtask.models import NewTask

    buffered = (
        doc.get("buffered_tick") if isinstance(doc.get("buffered_tick"), dt.datetime) else None
    )
    start = doc.get("after_buffer") if buffered is not None else doc["next_tick_at"]
    if isinstance(start, dt.datetime):
        ticks, following = plan(schedule, trigger, start, now)
    else:
        ticks, following = [], None
    newest = ticks[-1] if ticks else None
    previous_open = (yield from _is_open(doc.get("last_key"))) if (newest or buffered) else False
    publish, held, skipped = overlap_step(schedule.overlap, newest, buffered, previous_open)
    skipped += max(0, len(ticks) - 1)  # one tick per pass: the older ones of this pass
    created = 0
    if publish is not None:
        task = NewTask.build(
            schedule.task, tick_key(schedule.id, publish), schedule.params, schedule.options
        )
        created = yield from store.publish_many([task], now)
    more: Doc = {}
    if skipped:
        more["$inc"] = {"skipped": skipped}
        more["$set"] = {"last_skipped_at": now}
    next_at: dt.datetime | None = following
    if held is not None:
        recheck = now + dt.timedelta(seconds=BUFFER_RECHECK_S)
        next_at = recheck if following is None else min(recheck, following)
        more["$set"] = {**more.get("$set", {}), "buffered_tick": held, "after_buffer": following}
    else:
        more["$unset"] = {"buffered_tick": "", "after_buffer": ""}
    yield from advance(doc, [publish] if publish else [], next_at, now, more=more)
    return created
