"""A parked task's journal changed by an operator, beside ``store.steps.reset``:
a step renamed or dropped so that a changed handler replays it (``remark``), and a failed or
cancelled task run again from a step (``retry_from``). Each is one update with the reset's
fence (``store.steps.reset_filter``: the task not running, and no run of it RUNNING), so it
cannot race a run: a run claimed after it reads the changed journal, and while one runs nothing
changes. What a removed step kept aside is removed after it (``store.steps.drop_spills``).
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

from mtask.driver import Call, Doc, Op
from mtask.errors import InvalidTask, TaskNotFound
from mtask.statemachine import RUNNING
from mtask.steps import MAX_STEPS, StepError, check_name
from mtask.store import steps as store_steps
from mtask.store.tasks import RETRIABLE, retry_filter, retry_pipeline
from mtask.vocabulary import TaskStatus


@dataclass(frozen=True)
class Remarked:
    """What a rename or a drop did: step ``step`` (at ``index``) renamed ``to``, or dropped
    (``to`` ``None``); ``woke``: a pending task that waited in the dropped step runs now."""

    key: str
    step: str
    to: str | None
    index: int
    woke: bool


def _name(value: Any, field: str) -> str:
    try:
        return check_name(value)
    except StepError as exc:
        raise InvalidTask(str(exc), field=field) from None


def _not_awaiting(step: str) -> Doc:
    """The filter's clause that keeps a spawn whose children are awaited as it is: their
    counts name it (``store.children``)."""
    awaited = {"name": step, "kind": "children", "state": "waiting"}
    return {"steps": {"$not": {"$elemMatch": awaited}}}


def rename_pipeline(step: str, to: str) -> list[Doc]:
    """Step ``step`` renamed ``to`` in the journal, and in ``waiting`` if it waits there."""
    renamed = {
        "$map": {
            "input": "$steps",
            "in": {
                "$cond": [
                    {"$eq": ["$$this.name", {"$literal": step}]},
                    {"$mergeObjects": ["$$this", {"name": {"$literal": to}}]},
                    "$$this",
                ]
            },
        }
    }
    waits_here = {"$eq": ["$waiting.step", {"$literal": step}]}
    waiting = {"$mergeObjects": ["$waiting", {"step": {"$literal": to}}]}
    return [
        {
            "$set": {
                "steps": renamed,
                "waiting": {"$cond": [waits_here, waiting, "$waiting"]},
                "updated_at": "$$NOW",
            }
        }
    ]


def drop_pipeline(step: str) -> list[Doc]:
    """Step ``step`` removed from the journal, the later ones moved up one place. A task that
    waits in it waits no more (and, pending, may run now); one that waits later keeps its wait
    at its new place. A signal a dropped wait took stays: the next wait of its name takes it."""
    cut = "$_cut"
    kept = {
        "$concatArrays": [
            {"$slice": ["$steps", cut]},
            {"$slice": ["$steps", {"$add": [cut, 1]}, MAX_STEPS]},
        ]
    }
    here = {"$eq": ["$waiting.index", cut]}
    later = {"$gt": ["$waiting.index", cut]}
    moved = {"$mergeObjects": ["$waiting", {"index": {"$subtract": ["$waiting.index", 1]}}]}
    wake = {"$and": [{"$eq": ["$status", TaskStatus.PENDING.value]}, here]}
    return [
        {"$set": {"_cut": {"$indexOfArray": ["$steps.name", {"$literal": step}]}}},
        {
            "$set": {
                "steps": kept,
                "waiting": {
                    "$switch": {
                        "branches": [
                            {"case": here, "then": "$$REMOVE"},
                            {"case": later, "then": moved},
                        ],
                        "default": "$waiting",
                    }
                },
                "available_at": {"$cond": [wake, "$$NOW", "$available_at"]},
                "next_claim_at": {"$cond": [wake, "$$NOW", "$next_claim_at"]},
                "updated_at": "$$NOW",
            }
        },
        {"$unset": "_cut"},
    ]


def remark(key: str, step: str, to: str | None = None) -> Op[Remarked]:
    """Rename step ``step`` of task ``key``'s journal ``to`` (a name no other step has), or
    drop it (``to`` ``None``), in one fenced update. ``TaskNotFound``; ``InvalidTask`` (field
    ``step`` or ``to``) for no such step or a bad name; ``InvalidTransition`` while the task
    runs, once it succeeded, for a name another step has, or a spawn whose children are
    awaited."""
    step = _name(step, "step")
    filt = {**store_steps.reset_filter(key, step), "$and": [_not_awaiting(step)]}
    if to is None:
        pipeline = drop_pipeline(step)
    else:
        to = _name(to, "to")
        filt["$and"].append({"steps.name": {"$ne": to}})
        pipeline = rename_pipeline(step, to)
    before: Doc = yield from store_steps.edit(key, step, filt, pipeline)
    steps = [s for s in before.get("steps") or [] if isinstance(s, dict)]
    index = next(i for i, s in enumerate(steps) if s.get("name") == step)
    if to is None:
        yield from store_steps.drop_spills(key, [steps[index]])
    waiting = before.get("waiting")
    woke = (
        to is None
        and before.get("status") == TaskStatus.PENDING.value
        and isinstance(waiting, dict)
        and waiting.get("index") == index
    )
    return Remarked(key, step, to, index, woke)


def retry_from(key: str, step: str, now: dt.datetime) -> Op[Doc]:
    """Run failed or cancelled task ``key`` again from step ``step``: the steps before it are
    kept, it and the later ones removed (``store.steps.reset_pipeline``), and the task reopened
    with a fresh retry budget (``store.tasks.retry_pipeline``), in one update fenced like a
    reset. Returns the task as it is now. ``InvalidTask`` for no such step; ``TaskNotFound``;
    ``InvalidTransition`` for a task that is not failed or cancelled, or runs."""
    step = _name(step, "step")
    filt = {
        **retry_filter(key, now),
        **store_steps.reset_filter(key, step),
        "status": {"$in": list(RETRIABLE)},
        "runs": {"$type": "array", "$not": {"$elemMatch": {"state": RUNNING}}},
    }
    pipeline = [*store_steps.reset_pipeline(step), *retry_pipeline(now)]
    before: Doc = yield from store_steps.edit(key, step, filt, pipeline, RETRIABLE)
    steps = [s for s in before.get("steps") or [] if isinstance(s, dict)]
    index = next(i for i, s in enumerate(steps) if s.get("name") == step)
    yield from store_steps.drop_spills(key, steps[index:])
    doc: Doc | None = yield Call("find_one", ({"_id": key},))
    if doc is None:  # removed right after the retry (a purge)
        raise TaskNotFound(key)
    return doc
