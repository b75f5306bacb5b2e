"""Children spawned and awaited without a slot, in MongoDB (``mtask.steps.children`` has
the story): the spawn (the parent's step and counter in one fenced update, then the children
published), each child counted on its parent once, the wake-up, the results read once, the
sweep that makes a lost wake-up impossible, and the cancel that reaches the open children.

Both ways in the documents: a child holds ``parent`` (the ``parent`` index finds a parent's
children, paged; no list of them grows in the parent, which stays far from 16 MiB at 100,000
children) and ``spawn: {parent, step, index}``; the parent holds ``spawned: {step, index,
total, done, failed, bits, checked_at}`` (``bits``: one 64-bit word per 32 children, about 40
KiB at 100,000) and, while it waits, ``waiting.children``, which the partial ``children_wait``
index holds: the sweep's question, and no key for any other task.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from bson.int64 import Int64
from pymongo import UpdateOne

from mtask.driver import Call, Doc, Op
from mtask.errors import LeaseLost
from mtask.steps import StepError
from mtask.steps.children import FINISHED, MAX_CHILDREN, word_bit, words
from mtask.store import steps as store_steps
from mtask.store.schema import OPEN_LIST, WELL_FORMED
from mtask.store.tasks import CANCEL_CHILDREN, cancel, cancel_pipeline, publish_many
from mtask.vocabulary import TaskStatus

PAGE = 1000
"""Children read per page when their parent resumes; parents whose children a cancel reaches
in one update."""
PUBLISH_BATCH = 1000
"""Children published in one bulk write, the parent looked at between two (``publish``)."""
COUNT_LIMIT = 1_000_000
"""The most children ``count`` counts (a step spawns at most ``MAX_CHILDREN``)."""
IN_PLACE_UP_TO = 1000
"""``first`` orders a parent's children by their place in their spawn up to this many (the
server sorts them all); beyond, in the ``parent`` index's order (when made, then by key)."""
WAITING_INDEX = "children_wait"
"""The parents waiting for children (``store.schema.INDEXES``): the sweep's question."""
OptionsFor = Callable[[str, Mapping[str, Any] | None], Any]


def counter(step: str, index: int, total: int) -> Doc:
    """A new spawn's counter on its parent: nothing finished, every bit clear."""
    return {
        "step": step,
        "index": index,
        "total": total,
        "done": 0,
        "failed": 0,
        "bits": [Int64(0)] * words(total),
    }


def spawn(
    key: str,
    run_id: str,
    index: int,
    entry: Mapping[str, Any],
    children: Sequence[Mapping[str, Any]],
    now: dt.datetime,
    options_for: OptionsFor | None = None,
) -> Op[int]:
    """Record the step ``entry`` (new, at ``index``) with the counter, fenced by the run
    (``store.steps.record``), then publish the children; returns how many were created. The
    counter and the children carry the spawn's ``tag`` (its generation, when the task spawned
    under this name before: ``mtask.steps.children.generation``), else its name."""
    step = str(entry.get("tag") or entry["name"])
    also = {"spawned": counter(step, index, len(children))}
    yield from store_steps.record(key, run_id, index, entry, None, also=also)
    created: int = yield from publish(key, step, children, now, options_for)
    return created


def publish(
    parent: str,
    step: str,
    children: Sequence[Mapping[str, Any]],
    now: dt.datetime,
    options_for: OptionsFor | None = None,
) -> Op[int]:
    """Publish the children of ``parent``'s step ``step`` (``mtask.steps.children.build``'s), each
    idempotently: one that exists stays as it is. ``options_for``: a name's declared defaults
    (``Registry.options_for``), when the worker knows the name. A child's ``trace`` (the
    spawning step's trace context, ``mtask.steps.children.linked``) is stored as its ``trace``.

    In batches of ``PUBLISH_BATCH``, the parent looked at before each and after the last: once
    it is cancelled, no batch more is published, the children published are cancelled and
    ``LeaseLost`` is raised. A cancel writes the parent, then reads its children; a batch is
    written, then the parent read: whichever comes second sees the other, so no child stays
    open (a run that dies between the two leaves its batch to the flow sweep:
    ``tasks.CANCEL_CHILDREN``)."""
    from mtask.models import NewTask

    tasks = [
        NewTask.build(
            c["name"],
            c["key"],
            c["params"],
            options_for(c["name"], c["options"]) if options_for else c["options"],
            parent=parent,
            spawn={"parent": parent, "step": step, "index": int(c["index"])},
        )
        for c in children
    ]
    trace = next((c["trace"] for c in children if c.get("trace")), None)  # the step's, or none
    created = 0
    for start in range(0, len(tasks), PUBLISH_BATCH):
        yield from _not_cancelled(parent, now)
        batch = tasks[start : start + PUBLISH_BATCH]
        made = yield from publish_many(batch, now, trace=trace)
        if made < len(batch):  # some keys were taken: by these children, or by another task
            yield from _not_taken(parent, step, [t.key for t in batch])
        created += made
    yield from _not_cancelled(parent, now)
    return created


def _not_taken(parent: str, step: str, keys: Sequence[str]) -> Op[None]:
    """``StepError`` naming the first of ``keys`` held by a task that is not a child of
    ``parent``'s spawn ``step``: the parent would wait for it for ever (its outcome is never
    counted here); the step fails instead, for good (it would on every replay)."""
    mine = {"spawn.parent": parent, "spawn.step": step}
    other: Doc | None = yield Call(
        "find_one",
        ({"_id": {"$in": list(keys)}, "$nor": [mine]}, {"name": 1, "parent": 1, "spawn": 1}),
    )
    if other is None:
        return
    owner = other.get("parent")
    spawn = other.get("spawn")
    if isinstance(spawn, Mapping) and spawn.get("step") is not None:
        by = f"spawned by {spawn.get('parent')!r}'s step {spawn.get('step')!r}"
    elif isinstance(owner, str):
        by = f"made by {owner!r}"
    else:
        by = "published on its own"
    raise StepError(
        f"step {step!r} cannot spawn child {other['_id']!r}: a task of that key exists, "
        f"{other.get('name')!r} {by}, not a child of {parent!r}; give the child another key "
        "(Spawn(key=...)) or remove that task, then retry"
    )


def _not_cancelled(parent: str, now: dt.datetime) -> Op[None]:
    """``LeaseLost`` if ``parent`` was cancelled, once its open children are cancelled."""
    doc: Doc | None = yield Call("find_one", ({"_id": parent}, {"status": 1}))
    if doc is not None and doc.get("status") == TaskStatus.CANCELLED.value:
        yield from cancel_children(parent, now)
        raise LeaseLost(f"task {parent!r} was cancelled while it spawned: its children too")


def children(parent: str, step: str) -> Op[list[Doc]]:
    """The children of ``parent``'s step ``step``, in spawn order, each ``{index, key, name,
    status, result, error}``: read in pages of ``PAGE`` by the ``parent`` index."""
    found: list[Doc] = []
    after: Doc | None = None
    fields = {"name": 1, "status": 1, "result": 1, "error": 1, "spawn": 1, "created_at": 1}
    while True:
        filt: Doc = {"parent": parent, "spawn.step": step}
        if after is not None:
            filt["$or"] = [
                {"created_at": {"$gt": after["created_at"]}},
                {"created_at": after["created_at"], "_id": {"$gt": after["_id"]}},
            ]
        page: list[Doc] = yield Call(
            "find",
            (filt, fields),
            {"sort": [("created_at", 1), ("_id", 1)], "limit": PAGE, "hint": "parent"},
        )
        found += page
        if len(page) < PAGE:
            break
        after = page[-1]
    return sorted((_child(d) for d in found if _place(d.get("spawn"))), key=lambda c: c["index"])


def _child(doc: Mapping[str, Any]) -> Doc:
    return {
        "index": doc["spawn"]["index"],
        "key": doc["_id"],
        "name": doc.get("name"),
        "status": doc.get("status"),
        "result": doc.get("result"),
        "error": doc.get("error"),
    }


def _place(spawn: Any) -> tuple[str, str, int] | None:
    """A child's ``spawn`` as ``(parent, step, index)``, or ``None`` for any other shape."""
    if not isinstance(spawn, Mapping):
        return None
    parent, step, index = spawn.get("parent"), spawn.get("step"), spawn.get("index")
    if not isinstance(parent, str) or not isinstance(step, str):
        return None
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < MAX_CHILDREN:
        return None
    return parent, step, index


def count_request(spawn: Any, succeeded: bool) -> UpdateOne | None:
    """The update that counts one finished child on its parent, once: it sets the child's bit
    only where it is clear, and counts it in the same atomic update (a second count of the same
    child matches nothing). ``None`` for a ``spawn`` of another shape."""
    place = _place(spawn)
    if place is None:
        return None
    parent, step, index = place
    word, bit = word_bit(index)
    field = f"spawned.bits.{word}"
    counts = {"spawned.done": 1} if succeeded else {"spawned.done": 1, "spawned.failed": 1}
    return UpdateOne(
        {"_id": parent, "spawned.step": step, field: {"$bitsAllClear": [bit]}},
        {"$bit": {field: {"or": Int64(1 << bit)}}, "$inc": counts},
    )


def wake_filter(parents: Sequence[Any]) -> Doc:
    """The parents among ``parents`` that wait for their children, all of them finished."""
    return {
        "_id": {"$in": list(parents)},
        "status": TaskStatus.PENDING.value,
        "waiting.children": {"$exists": True},
        "$expr": {
            "$and": [
                {"$eq": ["$waiting.children", "$spawned.step"]},
                {"$gte": ["$spawned.done", "$spawned.total"]},
            ]
        },
    }


WAKE: list[Doc] = [
    {"$set": {"available_at": "$$NOW", "next_claim_at": "$$NOW", "updated_at": "$$NOW"}}
]
"""A parent made claimable now, on the server's clock (as a signal wakes a wait)."""


def count_finished(keys: Sequence[str]) -> Op[int]:
    """After the outcomes of spawned children were recorded: count on their parents those that
    finished for good (a failure with a retry left is not), then wake the parents whose count
    is full; returns how many parents woke. One read, one bulk write, one update."""
    docs: list[Doc] = yield Call(
        "find",
        (
            {"_id": {"$in": list(keys)}, "status": {"$in": list(FINISHED)}},
            {"status": 1, "spawn": 1},
        ),
    )
    requests, parents = [], set()
    for doc in docs:
        request = count_request(doc.get("spawn"), doc.get("status") == TaskStatus.SUCCEEDED.value)
        if request is not None:
            requests.append(request)
            parents.add(doc["spawn"]["parent"])
    if not requests:
        return 0
    yield Call("bulk_write", (requests,), {"ordered": False})
    result = yield Call("update_many", (wake_filter(sorted(parents)), WAKE))
    return int(result.modified_count)


def sweep(stale: dt.datetime, recheck: dt.datetime, limit: int = 100) -> Op[int]:
    """Parents that have waited since before ``stale`` and were not counted since ``recheck``:
    count their finished children (the ``parent`` index); wake those whose children all
    finished (a worker died between a child's outcome and its count), note the count's time on
    the others. Returns how many woke."""
    docs: list[Doc] = yield Call(
        "find",
        (
            {
                "waiting.children": {"$exists": True},
                "status": TaskStatus.PENDING.value,
                "updated_at": {"$lt": stale},
                "spawned.checked_at": {"$not": {"$gte": recheck}},
            },
            {"waiting.children": 1, "spawned.step": 1, "spawned.total": 1},
        ),
        {"limit": limit, "hint": WAITING_INDEX},
    )
    woke = 0
    for doc in docs:
        woke += yield from _recount(doc)
    return woke


def _recount(doc: Mapping[str, Any]) -> Op[int]:
    spawned = doc.get("spawned")
    step = (doc.get("waiting") or {}).get("children")
    if not isinstance(spawned, Mapping) or spawned.get("step") != step or step is None:
        return 0
    finished: int = yield Call(
        "count_documents",
        ({"parent": doc["_id"], "spawn.step": step, "status": {"$in": list(FINISHED)}},),
        {"hint": "parent"},
    )
    total = spawned.get("total")
    if isinstance(total, int) and finished >= total:
        filt = {"_id": doc["_id"], "status": TaskStatus.PENDING.value, "waiting.children": step}
        result = yield Call("update_one", (filt, WAKE))
        return int(result.modified_count)
    yield Call(
        "update_one",
        ({"_id": doc["_id"], "spawned.step": step}, {"$currentDate": {"spawned.checked_at": True}}),
    )
    return 0


def cancel_tree(key: str, now: dt.datetime) -> Op[Doc]:
    """Cancel an open task (``store.tasks.cancel``) and, if it spawned children, its open
    children and theirs: one client's cancel, or each of a bulk cancel's tasks."""
    doc: Doc = yield from cancel(key, now)
    if doc.get("spawned") is not None:  # its children are not awaited any more
        yield from cancel_children(key, now)
    return doc


def cancel_children(key: str, now: dt.datetime) -> Op[int]:
    """Cancel the open children a cancelled task spawned, and theirs, level by level, however
    many (``PAGE`` parents at a time: one update of their open children by the ``parent``
    index, then one read of those that spawned in turn); returns how many were cancelled."""
    frontier, cancelled, seen = [key], 0, {key}
    while frontier:
        parents, frontier = frontier[:PAGE], frontier[PAGE:]
        mine: Doc = {"parent": {"$in": parents}, "spawn": {"$exists": True}}
        filt = {**mine, "status": {"$in": OPEN_LIST}, **WELL_FORMED}
        result = yield Call("update_many", (filt, cancel_pipeline(now)), {"hint": "parent"})
        cancelled += int(result.modified_count)
        spawning: list[Doc] = yield Call(
            "find", ({**mine, "spawned": {"$exists": True}}, {"_id": 1}), {"hint": "parent"}
        )
        for doc in spawning:
            if doc["_id"] not in seen:  # keys derive from their parent's: no loop but by hand
                seen.add(doc["_id"])
                frontier.append(doc["_id"])
    return cancelled


def sweep_cancelled(now: dt.datetime, limit: int = 100) -> Op[int]:
    """The tasks cancelled while a run of them may still have published children, whose run's
    lease has ended by ``now`` (``tasks.CANCEL_CHILDREN``): cancel their open children again,
    then remove the mark (fenced: a mark set again since stays). Returns how many children
    were cancelled."""
    docs: list[Doc] = yield Call(
        "find",
        ({CANCEL_CHILDREN: {"$lte": now}}, {CANCEL_CHILDREN: 1}),
        {"limit": limit, "hint": "cancel_children"},
    )
    cancelled = 0
    for doc in docs:
        cancelled += yield from cancel_children(doc["_id"], now)
        mark = {"_id": doc["_id"], CANCEL_CHILDREN: doc[CANCEL_CHILDREN]}
        yield Call("update_one", (mark, {"$unset": {CANCEL_CHILDREN: ""}}))
    return cancelled


def count(parent: str, limit: int = COUNT_LIMIT) -> Op[int]:
    """How many tasks ``parent`` made (its spawned children and its next steps), counted on
    the ``parent`` index up to ``limit``."""
    found: int = yield Call(
        "count_documents", ({"parent": parent},), {"limit": limit, "hint": "parent"}
    )
    return found


def first(parent: str, limit: int, total: int) -> Op[list[Doc]]:
    """The first ``limit`` of the ``total`` tasks ``parent`` made, as they were made: by when,
    then a spawned child by its place (``10`` after ``9``), up to ``IN_PLACE_UP_TO`` of them;
    beyond, by when, then by key (the ``parent`` index alone, however many there are)."""
    sort = [("created_at", 1), ("_id", 1)]
    if total <= IN_PLACE_UP_TO:
        sort.insert(1, ("spawn.index", 1))
    docs: list[Doc] = yield Call(
        "find", ({"parent": parent},), {"sort": sort, "limit": limit, "hint": "parent"}
    )
    return docs
