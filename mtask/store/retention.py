"""How long finished tasks are kept: per-name and global defaults, resolved at publish; the
release of flow parents held for their steps; and ``purge``, the operator's on-demand cleanup.

Expiry itself is MongoDB's TTL monitor: the update that finishes a task writes ``expire_at``
(``finished_at`` + the task's own ``options.keep_<status>_ms``, see
``statemachine.expire_fields``), and the ``expire`` TTL index (``expireAfterSeconds: 0``)
removes the document once that date has passed. No loop of ours deletes anything.

Defaults live in the ``retention`` collection, one document per name plus ``"*"`` for all
names::

    {_id: name | "*", succeeded_ms: int | -1 | null, failed_ms: ..., cancelled_ms: ...}

They are resolved when a task is published (from this small collection, which a client reads
at most once every ``CACHE_SECONDS``) and written into the task's options, so every document
states its own retention, whoever reads it and in whatever language; a change of defaults
applies to tasks published afterwards. A document inserted without these options (by hand, by
another language's driver) gets the built-in defaults (``vocabulary.DEFAULT_KEEP_MS``).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from pymongo import ReturnDocument

from mtask.driver import Call, Doc, Op
from mtask.errors import InvalidTask
from mtask.statemachine import OPEN, keep_ms
from mtask.store import output, steps
from mtask.vocabulary import (
    DEFAULT_KEEP_MS,
    FOREVER,
    KEEP_FIELDS,
    MAX_AGE_SECONDS,
    MAX_KEEP_MS,
    TaskStatus,
    validate_key,
    validate_name,
)

if TYPE_CHECKING:
    from mtask.models import NewTask

COLLECTION = "retention"
GLOBAL = "*"
CACHE_SECONDS = 10.0
"""How long a client reuses the defaults it read (``resolve``'s ``known``): a publish costs no
extra round trip, and a default changed by another process applies to tasks published at most
this long afterwards (at once for the client that changed it)."""
"""The ``retention`` document that holds the defaults for every name."""
PURGEABLE = tuple(s.value for s in TaskStatus if s.finished)
PURGE_DEFAULT_STATUSES = ("succeeded", "failed", "cancelled")
MAX_PURGE_KEYS = 10_000


def validate_keep(value: object, field: str) -> int | None:
    """A retention in ms: ``None`` (unset), ``-1`` (forever) or 0 .. ``MAX_KEEP_MS``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not FOREVER <= value <= MAX_KEEP_MS:
        raise InvalidTask(
            f"must be a number of milliseconds from 0 to {MAX_KEEP_MS}, or -1 (forever)",
            field=field,
        )
    return value


def set_defaults(
    name: str, succeeded_ms: int | None, failed_ms: int | None, cancelled_ms: int | None
) -> Op[Doc]:
    """Set the retention defaults of ``name`` (``"*"``: of every name); ``None`` leaves a
    status to the next level (the global default, then the built-in one)."""
    if name != GLOBAL:
        name = validate_name(name)
    values = {
        f"{status}_ms": validate_keep(value, f"{status}_ms")
        for status, value in zip(
            DEFAULT_KEEP_MS, (succeeded_ms, failed_ms, cancelled_ms), strict=True
        )
    }
    doc: Doc = yield Call(
        "find_one_and_update",
        ({"_id": name}, {"$set": values}),
        {"upsert": True, "return_document": ReturnDocument.AFTER},
        collection=COLLECTION,
    )
    return doc


def clear_defaults(name: str) -> Op[bool]:
    result = yield Call("delete_one", ({"_id": name},), collection=COLLECTION)
    return bool(result.deleted_count)


def all_defaults() -> Op[list[Doc]]:
    docs: list[Doc] = yield Call("find", ({},), {"sort": [("_id", 1)]}, collection=COLLECTION)
    return docs


class DefaultsCache:
    """A client's copy of ``all_defaults`` by id, good for ``CACHE_SECONDS`` (monotonic)."""

    def __init__(self) -> None:
        self._until = -1.0
        self._known: dict[str, Doc] = {}

    def get(self, now: float) -> dict[str, Doc] | None:
        return self._known if now < self._until else None

    def put(self, docs: Sequence[Doc], now: float) -> dict[str, Doc]:
        self._known = {d["_id"]: d for d in docs}
        self._until = now + CACHE_SECONDS
        return self._known

    def clear(self) -> None:
        self._until = -1.0


def _unset(task: NewTask) -> bool:
    return any(getattr(task.options, f) is None for f in KEEP_FIELDS.values())


def resolve(tasks: Sequence[NewTask], known: Mapping[str, Doc] | None = None) -> Op[list[NewTask]]:
    """``tasks`` with every unset ``keep_*_ms`` option filled from the name's default, else the
    global one, else the built-in one: one read of the ``retention`` collection, none if every
    task sets all three itself or the caller ``known``s the defaults (``all_defaults`` by id,
    read a moment ago: the clients keep them ``CACHE_SECONDS``)."""
    if not any(_unset(t) for t in tasks):
        return list(tasks)
    if known is None:
        names = sorted({t.name for t in tasks if _unset(t)})
        docs: list[Doc] = yield Call(
            "find", ({"_id": {"$in": [*names, GLOBAL]}},), collection=COLLECTION
        )
        known = {d["_id"]: d for d in docs}
    by_id = known
    out = []
    for task in tasks:
        if not _unset(task):
            out.append(task)
            continue
        fill: Doc = {}
        for status, option in KEEP_FIELDS.items():
            if getattr(task.options, option) is not None:
                continue
            fill[option] = _default(by_id.get(task.name), by_id.get(GLOBAL), status)
        out.append(task.model_copy(update={"options": task.options.model_copy(update=fill)}))
    return out


def _default(named: Mapping[str, Any] | None, common: Mapping[str, Any] | None, status: str) -> int:
    for doc in (named, common):
        value = (doc or {}).get(f"{status}_ms")
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return DEFAULT_KEEP_MS[status]


# ---------------------------------------------------------------------------------------------
# Flow parents: held while their steps are open
# ---------------------------------------------------------------------------------------------


def release_parents(now: dt.datetime, limit: int = 1000) -> Op[int]:
    """Give finished flow parents held for their steps (``expire_held``) their ``expire_at``
    once none of their steps is open: ``now`` + the parent's retention, so a flow is kept as a
    whole for that long after its last step ended. A parent whose outbox is not published yet
    is held too (its steps are its ``children``). Run by the flow sweep; returns how many."""
    held: list[Doc] = yield Call(
        "find",
        (
            {"expire_held": True, "outbox": {"$exists": False}},
            {"status": 1, "options": 1, "children": 1},
        ),
        {"limit": limit},
    )
    if not held:
        return 0
    busy_docs: list[Doc] = yield Call(
        "find",
        ({"parent": {"$in": [d["_id"] for d in held]}, "status": {"$in": list(OPEN)}},),
        {"projection": {"parent": 1}},
    )
    busy = {d.get("parent") for d in busy_docs}
    released = 0
    for doc in held:
        if doc["_id"] in busy:
            continue
        keep = keep_ms(doc.get("options") or {}, str(doc.get("status")))
        update: Doc = {"$unset": {"expire_held": ""}}
        if keep is not None:
            update["$set"] = {"expire_at": now + dt.timedelta(milliseconds=keep)}
        result = yield Call(
            "update_one",
            ({"_id": doc["_id"], "expire_held": True, "status": doc.get("status")}, update),
        )
        released += int(result.modified_count)
    return released


# ---------------------------------------------------------------------------------------------
# purge
# ---------------------------------------------------------------------------------------------


def purge_filter(
    now: dt.datetime,
    *,
    name: str | None = None,
    statuses: Sequence[str] | None = None,
    older_than: dt.timedelta | None = None,
    keys: Sequence[str] | None = None,
) -> Doc:
    """The filter of ``purge``: finished tasks only (never an open one: the status is part of
    the delete's own filter), never a flow parent whose steps are unpublished or open, narrowed
    by name, statuses, age (``finished_at`` at least ``older_than`` before ``now``) and keys.
    Bad input raises ``InvalidTask``."""
    wanted = list(statuses) if statuses else list(PURGE_DEFAULT_STATUSES)
    for status in wanted:
        if status not in PURGEABLE:
            raise InvalidTask(
                f"{status!r} cannot be purged; one of {', '.join(PURGEABLE)} "
                "(open tasks are never purged)",
                field="status",
            )
    filt: Doc = {
        "status": {"$in": sorted(set(wanted))},
        "outbox": {"$exists": False},
        "expire_held": {"$ne": True},
    }
    if name is not None:
        filt["name"] = validate_name(name)
    if older_than is not None:
        if not isinstance(older_than, dt.timedelta) or not (
            dt.timedelta(0) <= older_than <= dt.timedelta(seconds=MAX_AGE_SECONDS)
        ):
            raise InvalidTask(f"must be 0 to {MAX_AGE_SECONDS} seconds", field="older_than")
        filt["finished_at"] = {"$lte": now - older_than}
    if keys is not None:
        if not isinstance(keys, list | tuple) or not keys or len(keys) > MAX_PURGE_KEYS:
            raise InvalidTask(f"give 1 to {MAX_PURGE_KEYS} keys", field="keys")
        filt["_id"] = {"$in": [validate_key(k) for k in keys]}
    return filt


def purge_count(filt: Doc) -> Op[int]:
    """How many tasks ``purge`` would remove now (the dry run)."""
    count: int = yield Call("count_documents", (filt,))
    return count


def purge(filt: Doc) -> Op[int]:
    """Remove the finished tasks matching ``filt`` (from ``purge_filter``) in one
    ``delete_many``; returns how many were removed."""
    if not isinstance(filt.get("status"), Mapping) or any(
        s not in PURGEABLE for s in filt["status"].get("$in", [None])
    ):
        raise InvalidTask("a purge filter must come from purge_filter", field="filter")
    # the live output of the tasks that have some (docs/output.md) goes with them
    with_output = yield Call("find", ({**filt, "output_seq": {"$gt": 0}}, {"_id": 1}))
    # and the step results stored aside (docs/steps.md)
    with_spills = yield Call("find", ({**filt, "steps.spill": {"$exists": True}}, {"_id": 1}))
    result = yield Call("delete_many", (filt,))
    for side, docs in ((output.purge, with_output), (steps.purge, with_spills)):
        keys = [doc["_id"] for doc in docs]
        for start in range(0, len(keys), MAX_PURGE_KEYS):
            yield from side(keys[start : start + MAX_PURGE_KEYS])
    return int(result.deleted_count)
