"""Waits on data (docs/triggers.md): a task whose handler waits until a document of the
application's own collection is in some state (``ctx.wait_until``).

The wait is the task's ``waiting`` with ``data``: ``{collection, ids, filter}`` (the documents'
``_id``s the predicate names, and the predicate itself, a find filter). MongoDB decides whether
it holds (``find``, and ``holding``'s ``$facet`` for many waits in one round trip); no Python
reads the query language. A change to one of the ``ids`` finds its tasks through one partial
index (``data_waits``: collection and ids, only on tasks that wait on data) and wakes those
whose predicate holds with one atomic update, as a signal does (``wake_pipeline``): a pending
task becomes claimable now; a running one, still deciding to wait, is marked ``woke``, and its
WAITING write makes it claimable now (``store.outcomes``). The run announces its wait before
its last look (``announce``), so a change between that look and its WAITING write is not lost.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pymongo import ASCENDING, IndexModel
from pymongo.errors import OperationFailure

from mtask.connection.clients import CODEC_OPTIONS
from mtask.driver import Call, Doc, Op
from mtask.errors import LeaseLost
from mtask.store.schema import literal
from mtask.store.steps import fence
from mtask.vocabulary import OPEN_STATUSES, TaskStatus

COLLECTION = "waiting.data.collection"
IDS = "waiting.data.ids"
INDEX_NAME = "data_waits"
INDEX = IndexModel(
    [(COLLECTION, ASCENDING), (IDS, ASCENDING)],
    name=INDEX_NAME,
    partialFilterExpression={COLLECTION: {"$exists": True}},
)
"""Only tasks that wait on data hold a key (one per document they name): a worker that never
waits on data writes none. Made by the workers whose registry ``waits_on`` a collection."""
CHECK_BATCH = 100
"""Waits checked in one ``$facet`` (one sub-pipeline each)."""


def ensure_index() -> Op[None]:
    yield Call("create_indexes", ([INDEX],))


def find(collection: str, predicate: Doc) -> Op[Doc | None]:
    """The document of ``collection`` that ``predicate`` matches now, or ``None``."""
    reply: Doc = yield Call(
        "command",
        ({"find": collection, "filter": predicate, "limit": 1, "singleBatch": True},),
        {"codec_options": CODEC_OPTIONS},
    )
    batch = reply.get("cursor", {}).get("firstBatch") or []
    return batch[0] if batch else None


def announce(key: str, run_id: str, waiting: Doc) -> Op[None]:
    """Record the run's data wait in ``waiting`` while the run still owns its task (fenced as a
    step's record; ``LeaseLost`` if it does not): from now on a change wakes it."""
    result = yield Call(
        "update_one", (fence(key, run_id), [{"$set": {"waiting": literal(waiting)}}])
    )
    if not result.matched_count:
        raise LeaseLost(f"run {run_id} of {key!r} no longer owns the task: wait not announced")


def waiting_on(collection: str, ids: Sequence[Any]) -> Op[list[Doc]]:
    """The open tasks whose data wait names one of ``ids`` of ``collection`` (the index)."""
    docs: list[Doc] = yield Call(
        "find",
        (
            {
                COLLECTION: collection,
                IDS: {"$in": list(ids)},
                "status": {"$in": list(OPEN_STATUSES)},
            },
            {"waiting": 1},
        ),
        {"hint": INDEX_NAME},
    )
    return [d for d in docs if _wait_of(d) is not None]


def open_waits(collection: str, after: str | None, limit: int) -> Op[list[Doc]]:
    """A page of the pending tasks waiting on ``collection`` and not claimable already, by key
    (the sweep's re-check; ``holding`` skips a wait of any other shape)."""
    filt: Doc = {COLLECTION: collection, **NOT_WOKEN["$or"][0]}
    if after is not None:
        filt["_id"] = {"$gt": after}
    docs: list[Doc] = yield Call(
        "find",
        (filt, {"waiting": 1}),
        {"hint": INDEX_NAME, "sort": [("_id", ASCENDING)], "limit": limit},
    )
    return docs


def _wait_of(doc: Doc) -> Doc | None:
    """A task's data wait, if it is well formed (a document of any shape is skipped)."""
    waiting = doc.get("waiting")
    if not isinstance(waiting, dict) or not isinstance(waiting.get("index"), int):
        return None
    data = waiting.get("data")
    if not isinstance(data, dict) or not isinstance(data.get("filter"), dict):
        return None
    return data if isinstance(data.get("ids"), list) else None


def holding(collection: str, tasks: Sequence[Doc]) -> Op[list[Doc]]:
    """Those of ``tasks`` (as ``waiting_on`` reads them) whose predicate holds now: MongoDB
    decides, one ``$facet`` sub-pipeline a wait, ``CHECK_BATCH`` waits a round trip. A
    predicate the server refuses wakes its task (its run looks again, and says why it fails)."""
    found: list[Doc] = []
    well_formed = [t for t in tasks if _wait_of(t) is not None]  # any other shape: skipped
    for start in range(0, len(well_formed), CHECK_BATCH):
        batch = well_formed[start : start + CHECK_BATCH]
        waits = [_wait_of(t) or {} for t in batch]
        ids = [i for w in waits for i in w.get("ids", [])]
        facets = {
            str(n): [{"$match": w["filter"]}, {"$limit": 1}, {"$project": {"_id": 1}}]
            for n, w in enumerate(waits)
        }
        try:
            reply: Doc = yield Call(
                "command",
                (
                    {
                        "aggregate": collection,
                        "pipeline": [{"$match": {"_id": {"$in": ids}}}, {"$facet": facets}],
                        "cursor": {},
                    },
                ),
                {"codec_options": CODEC_OPTIONS},
            )
        except OperationFailure:  # a predicate the server refuses: each wait on its own
            found += yield from _one_by_one(collection, batch)
            continue
        results = (reply.get("cursor", {}).get("firstBatch") or [{}])[0]
        found += [t for n, t in enumerate(batch) if results.get(str(n))]
    return found


def _one_by_one(collection: str, tasks: Sequence[Doc]) -> Op[list[Doc]]:
    found = []
    for task in tasks:
        wait = _wait_of(task) or {}
        try:
            doc = yield from find(collection, wait["filter"])
        except OperationFailure:  # a predicate the server refuses: its run looks, and fails
            doc = {}
        if doc is not None:
            found.append(task)
    return found


def wake_pipeline() -> list[Doc]:
    """The update that wakes a data wait, as a signal wakes a signal wait
    (``store.steps.signal_pipeline``): a pending task claimable now; a running one marked
    ``woke``, which its WAITING write reads."""
    pending = {"$eq": ["$status", TaskStatus.PENDING.value]}
    data = {"$mergeObjects": ["$waiting.data", {"woke": "$$NOW"}]}
    return [
        {
            "$set": {
                "available_at": {"$cond": [pending, "$$NOW", "$available_at"]},
                "next_claim_at": {"$cond": [pending, "$$NOW", "$next_claim_at"]},
                "waiting": {"$mergeObjects": ["$waiting", {"data": data}]},
                "updated_at": "$$NOW",
            }
        }
    ]


NOT_WOKEN: Doc = {
    "$or": [
        {"status": TaskStatus.PENDING.value, "$expr": {"$gt": ["$next_claim_at", "$$NOW"]}},
        {"status": TaskStatus.RUNNING.value, "waiting.data.woke": {"$exists": False}},
    ]
}
"""A wait not woken yet: a pending task not claimable already, a running one not marked. A
task woken and not yet claimed (no worker free for its name) is not written again by every
change and sweep: its place in the claim queue stays."""


def wake(tasks: Sequence[Doc]) -> Op[int]:
    """Wake ``tasks`` (each ``{_id, waiting}`` as read) if each still waits on that very wait
    (its step's index) and is not woken yet; returns how many were woken."""
    if not tasks:
        return 0
    same = [{"_id": t["_id"], "waiting.index": t["waiting"]["index"]} for t in tasks]
    filt = {"$and": [{"$or": same}, NOT_WOKEN], COLLECTION: {"$exists": True}}
    result = yield Call("update_many", (filt, wake_pipeline()))
    return int(result.modified_count)
