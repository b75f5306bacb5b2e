"""A task's live output in MongoDB: its progress, its runs' log lines and output chunks.

Progress is a field of the task document (``progress``). Log lines and chunks go to a side
collection, ``<tasks>.output`` (named like GridFS's ``fs.chunks``), one document per line or
chunk, so the task document stays small::

    {_id: ObjectId, task: key, seq: int, run_id, attempt, kind: "log" | "chunk", at: date,
     level, message, fields     (a log line)
     data                       (a chunk: a string, bytes, or any BSON value)
     expire_at: date}           (removed with the task: see ``seal``)

``seq`` numbers every line and chunk of one task, from 1, in the order they were written,
across runs: it is the task document's ``output_seq``, incremented by the same fenced update
that proves the run still owns the task, in the transaction that inserts the entries
(``write``). A zombie's write matches nothing and its transaction aborts; two writers of one
task conflict on the task document, so one commits first and the numbers follow commit order.
A reader that has every entry up to ``n`` reads ``seq > n`` and misses nothing (``read``).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from typing import Any

from pymongo import ASCENDING, DESCENDING, IndexModel, ReturnDocument

from mtask.driver import Call, Doc, Op
from mtask.statemachine import RUNNING, keep_ms
from mtask.store.transactional import OUTPUT_TXN_FIELD, run_fence
from mtask.vocabulary import FINISHED_STATUSES, KEEP_FIELDS

COLLECTION = "output"
"""The key of the side collection in ``driver.collections``: ``<tasks>.output``."""
KINDS = ("log", "chunk")
INDEXES = [
    IndexModel([("task", ASCENDING), ("seq", ASCENDING)], name="task_seq", unique=True),
    IndexModel(
        [("expire_at", ASCENDING)],
        name="expire",
        expireAfterSeconds=0,
        partialFilterExpression={"expire_at": {"$type": "date"}},
    ),
]
MAX_READ = 1000
"""The most entries one ``read`` returns."""
FINISHED = sorted(s.value for s in FINISHED_STATUSES)


def collection_name(tasks: str) -> str:
    return f"{tasks}.output"


def ensure_indexes() -> Op[None]:
    """The side collection's indexes (a worker creates them before its first write)."""
    yield Call("create_indexes", (INDEXES,), collection=COLLECTION)


def keep_until(options: Mapping[str, Any], now: dt.datetime) -> dt.datetime | None:
    """How long entries written now are kept if their task's end never seals them (its worker
    died between the outcome and ``seal``): the task's longest retention from now; ``None``
    (kept) if any of its retentions is forever."""
    keeps = [keep_ms(options, status) for status in KEEP_FIELDS]
    if any(k is None for k in keeps):
        return None
    return now + dt.timedelta(milliseconds=max(k for k in keeps if k is not None))


def record_session(key: str, run_id: str, session_uuid: Any) -> Op[bool]:
    """Before a run's first transaction of output: the id of the session its transactions use
    (``lsid.id``) into its run entry (``output_txn``), fenced as ``write`` is, outside any
    transaction. A run frozen or killed between a transaction's fenced update and its commit
    leaves that transaction open, holding the task document: a claim taking the task over
    would wait for it until the server gives it up (a minute or more); with the id recorded,
    the claimer kills it (``store.transactional.expired_transactions``). ``False``: the run no
    longer owns its task."""
    set_it = {"$set": {f"runs.$.{OUTPUT_TXN_FIELD}": session_uuid}}
    result = yield Call("update_one", (run_fence(key, run_id), set_it))
    return bool(result.matched_count)


def write(
    key: str,
    run_id: str,
    attempt: int,
    batch: int,
    *,
    progress: Doc | None,
    counts: Doc | None,
    entries: Sequence[Doc],
    expire_at: dt.datetime | None,
    now: dt.datetime,
) -> Op[bool]:
    """Record batch number ``batch`` of a run (numbered from 1, a retry keeps its number):
    its progress (``{fraction, label}``), its output counts and ``entries`` (log lines and
    chunks, without ``task``/``seq``/``run_id``), if the run still owns the task: RUNNING, its
    task ``running``, its lease unexpired on the server's clock. ``False``: it does not, and
    nothing was written. With entries, run it in a transaction (the fenced update numbers them,
    the insert stores them; they commit together).

    A batch is written once even if it is sent again (a reply lost after its commit): the
    update records the batch's number in the run entry (``output_batch``) and matches only a
    run that has not recorded it; a run that has is answered ``True`` without writing."""
    run = {"run_id": run_id, "state": RUNNING}
    filt = run_fence(key, run_id, output_batch={"$not": {"$gte": batch}})
    sets: Doc = {"runs.$.output_batch": batch}
    if progress is not None:
        sets["progress"] = {**progress, "run_id": run_id, "attempt": attempt, "at": now}
    if counts is not None:
        sets["runs.$.output"] = dict(counts)
    update: Doc = {"$set": sets}
    if entries:
        update["$inc"] = {"output_seq": len(entries)}
    doc: Doc | None = None
    if entries:  # their numbers: the counter after the update
        doc = yield Call(
            "find_one_and_update",
            (filt, update),
            {"projection": {"output_seq": 1}, "return_document": ReturnDocument.AFTER},
        )
    else:  # whether it matched is all there is to know: no document to send back
        result = yield Call("update_one", (filt, update))
        doc = {} if result.matched_count else None
    if doc is None:
        done = {"_id": key, "runs": {"$elemMatch": {**run, "output_batch": {"$gte": batch}}}}
        written: Doc | None = yield Call("find_one", (done, {"_id": 1}))
        return written is not None  # written before (its reply was lost), or lost the task
    if entries:
        first = int(doc["output_seq"]) - len(entries) + 1
        expiry = {} if expire_at is None else {"expire_at": expire_at}
        docs = [
            {"task": key, "seq": first + i, "run_id": run_id, "attempt": attempt, **e, **expiry}
            for i, e in enumerate(entries)
        ]
        yield Call("insert_many", (docs,), {"ordered": True}, collection=COLLECTION)
    return True


def skip_past_stored(key: str, run_id: str) -> Op[bool]:
    """After ``write``'s insert met an entry with one of its numbers (a duplicate key): move
    the task's ``output_seq`` past the highest ``seq`` stored for its key, if the run still
    owns the task, so that the batch sent again is numbered after them. Such entries belong to
    an earlier task of the same key, removed (by retention, or by hand) before its entries
    were; they keep their numbers and go with this task. ``False``: nothing to move past."""
    docs: list[Doc] = yield Call(
        "find",
        ({"task": key}, {"_id": 0, "seq": 1}),
        {"sort": [("seq", DESCENDING)], "limit": 1},
        collection=COLLECTION,
    )
    highest = docs[0].get("seq") if docs else None
    if not isinstance(highest, int) or isinstance(highest, bool):
        return False
    result = yield Call("update_one", (run_fence(key, run_id), {"$max": {"output_seq": highest}}))
    return bool(result.matched_count)


def read_filter(key: str, after: int = 0, kinds: Sequence[str] | None = None) -> Doc:
    filt: Doc = {"task": key, "seq": {"$gt": after}}
    if kinds is not None:
        filt["kind"] = {"$in": list(kinds)}
    return filt


def read(
    key: str, after: int = 0, kinds: Sequence[str] | None = None, limit: int = MAX_READ
) -> Op[list[Doc]]:
    """The task's entries after ``after`` (a ``seq``), in order, at most ``limit``."""
    docs: list[Doc] = yield Call(
        "find",
        (read_filter(key, after, kinds), {"_id": 0, "expire_at": 0}),
        {"sort": [("seq", ASCENDING)], "limit": max(1, min(limit, MAX_READ))},
        collection=COLLECTION,
    )
    return docs


def seal(keys: Sequence[str]) -> Op[int]:
    """After the outcome of runs that wrote output: give the entries of each finished task
    its ``expire_at`` (unset: kept as long as the task is), so retention removes them with
    it. Open tasks are left alone (a retry's run writes more; the last seals). Returns the
    entries changed."""
    changed: int = yield from seal_in(COLLECTION, keys)
    return changed


def seal_in(collection: str, keys: Sequence[str]) -> Op[int]:
    """``seal`` for the side collection ``collection`` (documents with a ``task`` field):
    ``store.output``'s entries, ``store.steps``' spilled results."""
    docs: list[Doc] = yield Call(
        "find",
        ({"_id": {"$in": list(keys)}, "status": {"$in": FINISHED}},),
        {"projection": {"expire_at": 1, "expire_held": 1}},
    )
    changed = 0
    for doc in docs:
        expire_at = doc.get("expire_at")
        if isinstance(expire_at, dt.datetime):
            update: Doc = {"$set": {"expire_at": expire_at}}
        elif doc.get("expire_held") is True:
            continue  # a flow parent waiting for its steps: the safety expiry stands
        else:
            update = {"$unset": {"expire_at": ""}}  # kept forever, as the task is
        result = yield Call("update_many", ({"task": doc["_id"]}, update), collection=collection)
        changed += result.modified_count
    return changed


def purge(keys: Sequence[str]) -> Op[int]:
    """Remove the entries of tasks that were removed (``purge``)."""
    result = yield Call("delete_many", ({"task": {"$in": list(keys)}},), collection=COLLECTION)
    return int(result.deleted_count)
