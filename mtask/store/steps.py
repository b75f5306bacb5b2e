"""Durable steps in MongoDB (docs/steps.md): a run's step records in its task document, fenced
by the run; results too large for it in the side collection ``<tasks>.steps``; signals.

The task document holds ``steps`` (one entry per step, in the order the handler asks for them,
see ``mtask.steps``), ``signals`` (``{name, payload, at}``, oldest first) and, while a run waits,
``waiting`` (``{until, index, step, signal, nth}``). A spilled result is a few documents::

    {_id: ObjectId, task: key, spill: id, n: 0, 1, …, data: Binary, expire_at: date}

written before the step's entry that names them (a zombie's spill is never named, and expires),
removed with the task (sealed to its ``expire_at`` after the outcome, like the output).
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import bson
from pymongo import ASCENDING, IndexModel

from mtask.driver import Call, Doc, Op
from mtask.errors import InvalidTask, InvalidTransition, LeaseLost, TaskNotFound
from mtask.statemachine import RUNNING
from mtask.steps import MAX_STEPS, SPILL_CHUNK_BYTES, StepError, check_name, check_signal_name
from mtask.store.output import seal_in
from mtask.store.transactional import TXN_FIELD, run_fence
from mtask.vocabulary import (
    MAX_PARAMS_DEPTH,
    OPEN_STATUSES,
    UNENCODABLE,
    TaskStatus,
    check_depth,
    encodable,
)

COLLECTION = "steps"
"""The key of the side collection in ``driver.collections``: ``<tasks>.steps``."""
INDEXES = [
    IndexModel([("task", ASCENDING), ("spill", ASCENDING), ("n", ASCENDING)], name="task_spill_n"),
    IndexModel(
        [("expire_at", ASCENDING)],
        name="expire",
        expireAfterSeconds=0,
        partialFilterExpression={"expire_at": {"$type": "date"}},
    ),
]
MAX_SIGNALS = 1000
"""The most signals one task keeps."""
MAX_PAYLOAD_BYTES = 64 * 1024
"""A signal's payload, as BSON, at most."""


def collection_name(tasks: str) -> str:
    return f"{tasks}.steps"


def ensure_indexes() -> Op[None]:
    yield Call("create_indexes", (INDEXES,), collection=COLLECTION)


def fence(key: str, run_id: str) -> Doc:
    """The filter of a run's step writes: its task running, the run RUNNING with its lease
    alive on the server's clock."""
    return run_fence(key, run_id)


def record_update(
    key: str, run_id: str, index: int, entry: Mapping[str, Any], prior: Mapping[str, Any] | None
) -> tuple[Doc, Doc]:
    """Filter and update writing step ``entry`` at ``index``: a new last entry (``prior`` is
    ``None``; the filter proves the journal is ``index`` long) or in place of ``prior`` (the
    filter proves it is still the one this run read). Either clears ``waiting``."""
    filt = fence(key, run_id)
    if prior is None:
        filt[f"steps.{index}"] = {"$exists": False}
        if index > 0:
            filt[f"steps.{index - 1}"] = {"$exists": True}
        update: Doc = {"$push": {"steps": dict(entry)}}
    else:
        filt[f"steps.{index}.name"] = prior.get("name")
        filt[f"steps.{index}.attempts"] = prior.get("attempts")
        filt[f"steps.{index}.state"] = prior.get("state")
        update = {"$set": {f"steps.{index}": dict(entry)}}
    update["$unset"] = {"waiting": ""}
    return filt, update


def record(
    key: str,
    run_id: str,
    index: int,
    entry: Mapping[str, Any],
    prior: Mapping[str, Any] | None,
    *,
    in_transaction: bool = False,
    also: Mapping[str, Any] | None = None,
) -> Op[None]:
    """Write a step's entry if the run still owns its task (``LeaseLost`` if not; nothing is
    written); ``StepError`` if another run of the task recorded that step meanwhile.
    ``in_transaction``: the record of a transactional step, which also clears the run's ``txn``
    (its session's id, written when the transaction began): once the step commits, its session
    goes back to the driver's pool, and a run taking the task over must not kill it there.
    ``also``: fields set in the same update (a spawn's counter of its children)."""
    filt, update = record_update(key, run_id, index, entry, prior)
    options: Doc = {}
    if in_transaction:
        update["$unset"][f"runs.$[mine].{TXN_FIELD}"] = ""
        options["array_filters"] = [{"mine.run_id": run_id}]
    if also:
        update["$set"] = {**update.get("$set", {}), **also}
    result = yield Call("update_one", (filt, update), options)
    if not result.matched_count:
        yield from _not_recorded(key, run_id, f"step {index + 1}")


def _not_recorded(key: str, run_id: str, step: str) -> Op[None]:
    """Why a step's fenced write matched nothing: the run lost its task, or another run of it
    recorded that step meanwhile."""
    owned: Doc | None = yield Call("find_one", (fence(key, run_id), {"_id": 1}))
    if owned is None:
        raise LeaseLost(f"run {run_id} of {key!r} no longer owns the task: step not recorded")
    raise StepError(f"{step} of {key!r} was recorded meanwhile by another run")


def record_named_update(
    key: str, run_id: str, entry: Mapping[str, Any], prior: Mapping[str, Any] | None
) -> tuple[Doc, Doc, Doc]:
    """Filter, update and options writing a parallel step's ``entry`` by its name (
    ``mtask.steps.parallel``): a new last entry if no step of the task has its name (the names are
    unique), else in place of ``prior``, which the filter proves is still the one the run read.
    Either clears ``waiting``, as ``record_update``."""
    name = entry["name"]
    filt = fence(key, run_id)
    options: Doc = {}
    if prior is None:
        filt["steps.name"] = {"$ne": name}
        filt[f"steps.{MAX_STEPS - 1}"] = {"$exists": False}
        update: Doc = {"$push": {"steps": dict(entry)}}
    else:
        read = {"name": name, "attempts": prior.get("attempts"), "state": prior.get("state")}
        filt["steps"] = {"$elemMatch": read}
        update = {"$set": {"steps.$[s]": dict(entry)}}
        options["array_filters"] = [{"s.name": name}]
    update["$unset"] = {"waiting": ""}
    return filt, update, options


def record_named(
    key: str, run_id: str, entry: Mapping[str, Any], prior: Mapping[str, Any] | None
) -> Op[None]:
    """``record`` for a parallel step (``record_named_update``)."""
    filt, update, options = record_named_update(key, run_id, entry, prior)
    result = yield Call("update_one", (filt, update), options)
    if not result.matched_count:
        yield from _not_recorded(key, run_id, f"step {entry['name']!r}")


def signals(key: str, name: str) -> Op[list[Doc]]:
    """The task's signals named ``name``, oldest first."""
    mine = {
        "$filter": {
            "input": {"$ifNull": ["$signals", []]},
            "cond": {"$eq": ["$$this.name", name]},
        }
    }
    doc: Doc | None = yield Call("find_one", ({"_id": key}, {"signals": mine}))
    found = (doc or {}).get("signals")
    return [s for s in found if isinstance(s, dict)] if isinstance(found, list) else []


def signal_pipeline(name: str, payload: Any) -> list[Doc]:
    """The update that signals a task (docs/steps.md gives it for any language): the signal
    appended to ``signals`` with the server's time, and the task made claimable now if it is
    waiting for this name. One atomic update: a wait that ends after it finds the signal, a
    wait that ended before it is woken by it."""
    entry = {"name": name, "payload": {"$literal": payload}, "at": "$$NOW"}
    wakes = {
        "$and": [
            {"$eq": ["$status", TaskStatus.PENDING.value]},
            {"$eq": ["$waiting.signal", name]},
        ]
    }
    return [
        {
            "$set": {
                "signals": {"$concatArrays": [{"$ifNull": ["$signals", []]}, [entry]]},
                "available_at": {"$cond": [wakes, "$$NOW", "$available_at"]},
                "next_claim_at": {"$cond": [wakes, "$$NOW", "$next_claim_at"]},
                "updated_at": "$$NOW",
            }
        }
    ]


def signal_filter(key: Any, name: str) -> Doc:
    """Which task a signal may be appended to: an open one holding fewer than ``MAX_SIGNALS``,
    or, past that cap, one waiting for this very signal (``waiting.signal`` and its ``nth``)
    and not yet holding it, so a full list never strands a wait: one more per wait, at most."""
    mine = {
        "$filter": {"input": {"$ifNull": ["$signals", []]}, "cond": {"$eq": ["$$this.name", name]}}
    }
    count = {"$size": mine}
    awaited = {
        "$and": [
            {"$eq": ["$status", TaskStatus.PENDING.value]},
            {"$eq": ["$waiting.signal", name]},
            {"$lte": [count, "$waiting.nth"]},
        ]
    }
    return {
        "_id": key,
        "status": {"$in": list(OPEN_STATUSES)},
        "$or": [{f"signals.{MAX_SIGNALS - 1}": {"$exists": False}}, {"$expr": awaited}],
    }


def check_signal(name: Any, payload: Any) -> None:
    try:
        check_signal_name(name)
    except StepError as exc:
        raise InvalidTask(str(exc), field="name") from None
    if not encodable(name):
        raise InvalidTask(UNENCODABLE, field="name")
    # as deep as params may be: the signal is stored three levels down in the task document
    # (MongoDB refuses past 100), and ctx.wait_for reads it back
    check_depth(payload, MAX_PARAMS_DEPTH, "payload")
    try:
        size = len(bson.encode({"payload": payload}))
    except Exception as exc:  # noqa: BLE001 - any encoding problem is the caller's
        raise InvalidTask(f"a signal's payload must be BSON: {exc}", field="payload") from None
    if size > MAX_PAYLOAD_BYTES:
        raise InvalidTask(
            f"the payload is {size} bytes as BSON; at most {MAX_PAYLOAD_BYTES}", field="payload"
        )


def signal(key: str, name: str, payload: Any = None) -> Op[bool]:
    """Send signal ``name`` to an open task; ``True`` if it woke the task (it was waiting for
    this name). ``TaskNotFound``, or ``InvalidTransition`` for a finished task or one holding
    ``MAX_SIGNALS`` already that waits for no more of this name (``signal_filter``)."""
    check_signal(name, payload)
    before: Doc | None = yield Call(
        "find_one_and_update",
        (signal_filter(key, name), signal_pipeline(name, payload)),
        {"projection": {"status": 1, "waiting": 1}},
    )
    if before is not None:
        waiting = before.get("waiting")
        return (
            before.get("status") == TaskStatus.PENDING.value
            and isinstance(waiting, dict)
            and waiting.get("signal") == name
        )
    doc: Doc | None = yield Call("find_one", ({"_id": key}, {"status": 1}))
    if doc is None:
        raise TaskNotFound(key)
    if doc.get("status") in OPEN_STATUSES:
        raise InvalidTransition(f"task {key!r} holds {MAX_SIGNALS} signals already")
    status = doc.get("status")
    again = (
        f" (retry it first, `mtask retry {key}`: its run waits for the signal again, and this one "
        "reaches it)"
        if status in (TaskStatus.FAILED.value, TaskStatus.CANCELLED.value)
        else ""
    )
    raise InvalidTransition(f"task {key!r} is {status}: it waits for no signal{again}")


RESETTABLE = (TaskStatus.PENDING.value, TaskStatus.FAILED.value, TaskStatus.CANCELLED.value)
"""A task's journal may be reset while it is one of these and no run of it is RUNNING."""


def reset_filter(key: str, step: str) -> Doc:
    """The fence of a reset: the task holds step ``step``, is not running, and no run of it is
    RUNNING (a cancelled task's run stops at its next ping). A run's step writes require the
    opposite (``fence``: the task running, the run RUNNING), and a claim makes the task running
    in its own atomic update, so the reset and any run's journal are ordered by MongoDB: a run
    claimed after the reset reads the shortened journal, and while one runs nothing is reset."""
    return {
        "_id": key,
        "status": {"$in": list(RESETTABLE)},
        "runs": {"$not": {"$elemMatch": {"state": RUNNING}}},
        "steps": {"$type": "array"},
        "steps.name": step,
    }


def reset_pipeline(step: str) -> list[Doc]:
    """Step ``step`` and every step after it removed from the journal (the next run calls them
    again: the replay rules need the recorded order, so a step in the middle cannot go alone).
    A signal a removed wait took is removed with it, so that the wait, asked for again, takes
    the next one of its name; the signals nothing took stay. A pending task (waiting in a
    removed step, or for its retry) may run now: the step was reset to be run again."""
    cut = {"$indexOfArray": ["$steps.name", step]}
    taken = {
        "$map": {
            "input": {
                "$filter": {
                    "input": {"$slice": ["$steps", cut, MAX_STEPS]},
                    "cond": {
                        "$and": [
                            {"$eq": ["$$this.kind", "signal"]},
                            {"$eq": ["$$this.state", "done"]},
                        ]
                    },
                }
            },
            "in": {"n": "$$this.signal", "i": "$$this.nth"},
        }
    }
    sent = {"$ifNull": ["$signals", []]}
    name_of = {"$let": {"vars": {"s": {"$arrayElemAt": [sent, "$$i"]}}, "in": "$$s.name"}}
    nth = {  # the i-th signal's place among the signals of its name
        "$size": {
            "$filter": {
                "input": {"$slice": [sent, "$$i"]},
                "as": "s",
                "cond": {"$eq": ["$$s.name", name_of]},
            }
        }
    }
    kept = {
        "$map": {
            "input": {
                "$filter": {
                    "input": {"$range": [0, {"$size": sent}]},
                    "as": "i",
                    "cond": {"$not": [{"$in": [{"n": name_of, "i": nth}, "$$taken"]}]},
                }
            },
            "as": "i",
            "in": {"$arrayElemAt": [sent, "$$i"]},
        }
    }
    stops = {"$gte": [{"$ifNull": ["$waiting.index", -1]}, cut]}
    wake = {"$eq": ["$status", TaskStatus.PENDING.value]}
    return [
        {
            "$set": {
                "signals": {
                    "$cond": [
                        {"$isArray": "$signals"},
                        {"$let": {"vars": {"taken": taken}, "in": kept}},
                        "$signals",
                    ]
                },
                "waiting": {"$cond": [stops, "$$REMOVE", "$waiting"]},
                "available_at": {"$cond": [wake, "$$NOW", "$available_at"]},
                "next_claim_at": {"$cond": [wake, "$$NOW", "$next_claim_at"]},
                "updated_at": "$$NOW",
            }
        },
        {"$set": {"steps": {"$slice": ["$steps", cut]}}},
    ]


@dataclass(frozen=True)
class Reset:
    """What a reset removed: the steps from ``step`` on (their names), the signals their waits
    had taken, and whether the task was pending (it may run now; a finished one is retried)."""

    key: str
    step: str
    index: int
    removed: list[str]
    signals: int
    woke: bool
    status: str | None = None
    """Its status before the reset: a failed or cancelled one runs again once retried."""


def reset(key: str, step: str) -> Op[Reset]:
    """Reset task ``key``'s journal to before step ``step`` (``reset_pipeline``), in one update
    fenced by ``reset_filter``; then remove the results the removed steps kept aside.
    ``TaskNotFound``; ``InvalidTransition`` while it runs or once it succeeded; ``InvalidTask``
    (field ``step``) if it has no such step."""
    try:
        check_name(step)
    except StepError as exc:
        raise InvalidTask(str(exc), field="step") from None
    before: Doc = yield from edit(key, step, reset_filter(key, step), reset_pipeline(step))
    steps = [s for s in before.get("steps") or [] if isinstance(s, dict)]
    index = next(i for i, s in enumerate(steps) if s.get("name") == step)
    removed = steps[index:]
    yield from drop_spills(key, removed)
    return Reset(
        key,
        step,
        index,
        [str(s.get("name")) for s in removed],
        sum(1 for s in removed if s.get("kind") == "signal" and s.get("state") == "done"),
        before.get("status") == TaskStatus.PENDING.value,
        None if before.get("status") is None else str(before.get("status")),
    )


def edit(
    key: str,
    step: str,
    filt: Doc,
    pipeline: list[Doc],
    allowed: tuple[str, ...] = RESETTABLE,
) -> Op[Doc]:
    """One fenced edit of task ``key``'s journal at step ``step`` (a reset, a rename, a drop,
    a retry from a step: ``filt`` holds ``reset_filter``'s fence): the document as it was
    before (its status, steps, wait and signals' names); else why it matched nothing."""
    before: Doc | None = yield Call(
        "find_one_and_update",
        (filt, pipeline),
        {"projection": {"status": 1, "steps": 1, "waiting": 1, "signals.name": 1}},
    )
    if before is None:
        yield from _not_reset(key, step, allowed)
    assert before is not None
    return before


def drop_spills(key: str, removed: Sequence[Mapping[str, Any]]) -> Op[None]:
    """Remove the results the ``removed`` steps kept aside."""
    spills = [s["spill"].get("id") for s in removed if isinstance(s.get("spill"), dict)]
    if spills:
        yield Call("delete_many", ({"task": key, "spill": {"$in": spills}},), collection=COLLECTION)


def _not_reset(key: str, step: str, allowed: tuple[str, ...] = RESETTABLE) -> Op[None]:
    """Why a reset matched nothing."""
    doc: Doc | None = yield Call(
        "find_one", ({"_id": key}, {"status": 1, "runs.state": 1, "steps.name": 1})
    )
    if doc is None:
        raise TaskNotFound(key)
    names = [str(s.get("name")) for s in doc.get("steps") or [] if isinstance(s, dict)]
    if step not in names:
        listed = ", ".join(repr(n) for n in names) if names else "none"
        raise InvalidTask(f"task {key!r} has no step {step!r} (its steps: {listed})", field="step")
    status = doc.get("status")
    if status == TaskStatus.RUNNING.value or any(
        isinstance(r, dict) and r.get("state") == RUNNING for r in doc.get("runs") or []
    ):
        hint = "its cancelled run stops at its next ping" if status != "running" else "cancel it"
        raise InvalidTransition(
            f"task {key!r} is running: its steps can be reset once its run ended ({hint})"
        )
    if status in allowed:  # a rename onto a taken name, or children awaited
        raise InvalidTransition(
            f"task {key!r}: step {step!r} cannot be changed so (another step has the new "
            "name, or its children are still awaited)"
        )
    if status in RESETTABLE:
        raise InvalidTransition(
            f"task {key!r} is {status}: this applies to {' or '.join(allowed)} tasks"
        )
    raise InvalidTransition(f"task {key!r} is {status}: its steps are kept as they ran")


def spill(key: str, data: bytes, expire_at: dt.datetime | None) -> Op[Doc]:
    """Store an encoded result aside, in chunks; returns the reference its entry holds."""
    ref = uuid.uuid4().hex
    chunks = [data[i : i + SPILL_CHUNK_BYTES] for i in range(0, len(data), SPILL_CHUNK_BYTES)]
    expiry = {} if expire_at is None else {"expire_at": expire_at}
    docs = [
        {"task": key, "spill": ref, "n": n, "data": bson.Binary(chunk), **expiry}
        for n, chunk in enumerate(chunks)
    ]
    for doc in docs:  # one at a time: a batch of them would pass the 48 MB message size
        yield Call("insert_one", (doc,), collection=COLLECTION)
    return {"id": ref, "chunks": len(docs), "bytes": len(data)}


def load(key: str, ref: Mapping[str, Any]) -> Op[bytes]:
    """A spilled result's bytes; ``StepError`` if a chunk is missing."""
    docs: list[Doc] = yield Call(
        "find",
        ({"task": key, "spill": ref.get("id")}, {"n": 1, "data": 1}),
        {"sort": [("n", ASCENDING)]},
        collection=COLLECTION,
    )
    if [d.get("n") for d in docs] != list(range(int(ref.get("chunks") or 0))):
        raise StepError(f"the stored result {ref.get('id')} of {key!r} is incomplete")
    return b"".join(bytes(d["data"]) for d in docs)


def seal(keys: Sequence[str]) -> Op[int]:
    """After the outcome of runs that spilled: their spills expire with the finished task."""
    changed: int = yield from seal_in(COLLECTION, keys)
    return changed


def purge(keys: Sequence[str]) -> Op[int]:
    """Remove the spilled results of tasks that were removed (``purge``)."""
    result = yield Call("delete_many", ({"task": {"$in": list(keys)}},), collection=COLLECTION)
    return int(result.deleted_count)
