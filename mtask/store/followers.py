"""Who follows a collection for the cluster, and where it is: one document per trigger and per
collection that tasks wait on, in ``triggers`` (docs/triggers.md).

A follower's lease is taken by one atomic update on the server's clock that matches only while
the lease is the caller's or has run out (as the relay's, ``store/relays.py``), and renewed
with its position in one bulk write for every follower a process holds. Every write of a
position is fenced by the holder (``holder: me``): a process that lost the lease (run out and
taken, or reset by an operator) writes nothing. The position is the change stream's resume
token after the last change whose tasks are published (or woken), its cluster time (``at``),
and the time up to which every change is handled (``through``: the lag is ``$$NOW`` minus it).

::

    {_id: "<tasks>/trigger/<name>" | "<tasks>/wait/<collection>", tasks, kind, name,
     collection, spec, holder, expires_at, since, paused, token, at, through,
     scan: {epoch, done, published, started_at, done_at} | null,
     changes, published, lost, lost_at, generation, created_at, declared_at}
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pymongo import ReturnDocument, UpdateOne

from mtask.driver import Call, Doc, Op
from mtask.store.relays import NOBODY

COLLECTION = "triggers"
Kind = Literal["trigger", "wait"]
KINDS: tuple[Kind, ...] = ("trigger", "wait")
STATE_FIELDS: Doc = {"spec": 0}
"""What a holder reads of its follower (the declaration is the registry's own)."""


def follower_id(tasks: str, kind: Kind, name: str) -> str:
    return f"{tasks}/{kind}/{name}"


@dataclass(frozen=True)
class Declared:
    """A follower as a registry declares it."""

    kind: Kind
    name: str
    collection: str
    spec: Doc
    scan_first: bool = False
    """A trigger that starts with a scan of the matching documents (once, when it is new)."""


@dataclass
class Progress:
    """What a holder writes with its lease's renewal: its position and its counts since the
    last write (``None``: unchanged)."""

    id: str
    token: Doc | None = None
    at: dt.datetime | None = None
    through: dt.datetime | None = None
    changes: int = 0
    published: int = 0
    extra: Doc = field(default_factory=dict)

    def sets(self) -> Doc:
        sets: Doc = {}
        if self.token is not None:
            sets["token"] = {"$literal": self.token}
        if self.at is not None:
            sets["at"] = self.at
        if self.through is not None:
            sets["through"] = self.through
        for name in ("changes", "published"):
            n = getattr(self, name)
            if n:
                sets[name] = {"$add": [{"$ifNull": [f"${name}", 0]}, n]}
        sets.update(self.extra)
        return sets


def declare(tasks: str, declared: Sequence[Declared], now: dt.datetime) -> Op[None]:
    """Each follower's document, created if missing (its first scan then, if asked), with the
    declaration as this registry says it."""
    requests = []
    for d in declared:
        fresh: Doc = {
            "tasks": tasks,
            "kind": d.kind,
            "name": d.name,
            "collection": d.collection,
            "holder": None,
            "expires_at": NOBODY,
            "paused": False,
            "token": None,
            "at": None,
            "through": None,
            "scan": {"epoch": 1, "done": False, "published": 0} if d.scan_first else None,
            "changes": 0,
            "published": 0,
            "lost": 0,
            "generation": 0,
            "created_at": now,
        }
        requests.append(
            UpdateOne(
                {"_id": follower_id(tasks, d.kind, d.name)},
                {"$setOnInsert": fresh, "$set": {"spec": d.spec, "declared_at": now}},
                upsert=True,
            )
        )
    if requests:
        yield Call("bulk_write", (requests,), {"ordered": False}, collection=COLLECTION)


def look(ids: Sequence[str]) -> Op[list[Doc]]:
    """Who holds each of ``ids``, whether its lease has run out (``free``) and whether it is
    paused: a standby's look, one read for all of them."""
    docs: list[Doc] = yield Call(
        "find",
        (
            {"_id": {"$in": list(ids)}},
            {
                "holder": 1,
                "paused": 1,
                "free": {"$lte": ["$expires_at", "$$NOW"]},
            },
        ),
        collection=COLLECTION,
    )
    return docs


def acquire(id: str, holder: str, ttl_ms: int) -> Op[Doc | None]:
    """Take ``id``'s lease for ``holder`` until ``ttl_ms`` from now (the server's clock) if it
    is not paused and is ``holder``'s or has run out; its state, or ``None``."""
    mine = {"$eq": ["$holder", holder]}
    state: Doc | None = yield Call(
        "find_one_and_update",
        (
            {
                "_id": id,
                "paused": {"$ne": True},
                "$or": [{"holder": holder}, {"$expr": {"$lte": ["$expires_at", "$$NOW"]}}],
            },
            [
                {
                    "$set": {
                        "holder": holder,
                        "expires_at": {"$add": ["$$NOW", ttl_ms]},
                        "since": {"$cond": [mine, "$since", "$$NOW"]},
                    }
                }
            ],
        ),
        {"projection": STATE_FIELDS, "return_document": ReturnDocument.AFTER},
        collection=COLLECTION,
    )
    return state


def renew(holder: str, held: Sequence[Progress], ttl_ms: int) -> Op[int]:
    """Renew ``holder``'s leases, each with its position, in one bulk write; returns how many
    it still holds (a paused one, or one reset or taken, is not renewed)."""
    if not held:
        return 0
    requests = [
        UpdateOne(
            {"_id": p.id, "holder": holder, "paused": {"$ne": True}},
            [{"$set": {"expires_at": {"$add": ["$$NOW", ttl_ms]}, **p.sets()}}],
        )
        for p in held
    ]
    result = yield Call("bulk_write", (requests,), {"ordered": False}, collection=COLLECTION)
    return int(result.matched_count)


def save(holder: str, progress: Progress) -> Op[bool]:
    """Write ``progress`` now (a fresh position, a scan's) if ``holder`` still holds it."""
    result = yield Call(
        "update_one",
        ({"_id": progress.id, "holder": holder}, [{"$set": progress.sets() or {"holder": holder}}]),
        collection=COLLECTION,
    )
    return bool(result.matched_count)


def release(holder: str, progress: Progress) -> Op[None]:
    """Write ``progress`` and end the lease now (a holder that stops): another takes it at once."""
    yield Call(
        "update_one",
        (
            {"_id": progress.id, "holder": holder},
            [{"$set": {**progress.sets(), "expires_at": NOBODY}}],
        ),
        collection=COLLECTION,
    )


def lost(holder: str, id: str) -> Op[Doc | None]:
    """The stream's history after the position is gone (the oplog rolled past it, the
    collection was dropped or renamed): start again from now with a scan of the matching
    documents (a new epoch of keys), counted in ``lost`` with ``lost_at``. Returns the new
    state, or ``None`` if ``holder`` no longer holds it."""
    epoch = {"$add": [{"$ifNull": ["$scan.epoch", 0]}, 1]}
    state: Doc | None = yield Call(
        "find_one_and_update",
        (
            {"_id": id, "holder": holder},
            [
                {
                    "$set": {
                        "token": None,
                        "scan": {"epoch": epoch, "done": False, "published": 0},
                        "lost": {"$add": [{"$ifNull": ["$lost", 0]}, 1]},
                        "lost_at": "$$NOW",
                    }
                }
            ],
        ),
        {"projection": STATE_FIELDS, "return_document": ReturnDocument.AFTER},
        collection=COLLECTION,
    )
    return state


# -- operators ----------------------------------------------------------------------------------


def _view() -> Doc:
    """A follower as operators read it, with its lag and lease on the server's clock."""
    return {
        "spec": 1,
        "kind": 1,
        "name": 1,
        "tasks": 1,
        "collection": 1,
        "holder": 1,
        "since": 1,
        "paused": 1,
        "at": 1,
        "through": 1,
        "scan": 1,
        "changes": 1,
        "published": 1,
        "lost": 1,
        "lost_at": 1,
        "generation": 1,
        "created_at": 1,
        "declared_at": 1,
        "held": {"$gt": ["$expires_at", "$$NOW"]},
        "lag_ms": {
            "$cond": [
                {"$eq": [{"$type": "$through"}, "date"]},
                {"$subtract": ["$$NOW", "$through"]},
                None,
            ]
        },
        "now": "$$NOW",
    }


def list_followers(tasks: str) -> Op[list[Doc]]:
    """Every follower of ``tasks``, triggers first, by name."""
    docs: list[Doc] = yield Call(
        "find",
        ({"tasks": tasks}, _view()),
        {"sort": [("kind", 1), ("name", 1)]},
        collection=COLLECTION,
    )
    return docs


def get(tasks: str, kind: Kind, name: str) -> Op[Doc | None]:
    docs: list[Doc] = yield Call(
        "find", ({"_id": follower_id(tasks, kind, name)}, _view()), collection=COLLECTION
    )
    return docs[0] if docs else None


def set_paused(tasks: str, kind: Kind, name: str, paused: bool) -> Op[bool]:
    """Pause or resume a follower: a paused one is not renewed (its holder stops within a
    renewal, its position kept) and nobody takes it; resumed, it goes on from its position.
    ``False``: there is no such follower."""
    result = yield Call(
        "update_one",
        ({"_id": follower_id(tasks, kind, name)}, {"$set": {"paused": paused}}),
        collection=COLLECTION,
    )
    return bool(result.matched_count)


def reset(tasks: str, kind: Kind, name: str, scan: bool) -> Op[bool]:
    """Forget a follower's position and end its lease: it starts again from now (with a scan of
    the matching documents first if ``scan``, a new epoch of keys). Its holder's next renewal
    finds the lease gone and stops. ``False``: there is no such follower."""
    epoch = {"$add": [{"$ifNull": ["$scan.epoch", 0]}, 1]}
    new_scan: Any = {"epoch": epoch, "done": False, "published": 0} if scan else None
    result = yield Call(
        "update_one",
        (
            {"_id": follower_id(tasks, kind, name)},
            [
                {
                    "$set": {
                        "holder": None,
                        "expires_at": NOBODY,
                        "token": None,
                        "at": None,
                        "through": None,
                        "scan": {"$literal": None} if new_scan is None else new_scan,
                        "generation": {"$add": [{"$ifNull": ["$generation", 0]}, 1]},
                    }
                }
            ],
        ),
        collection=COLLECTION,
    )
    return bool(result.matched_count)


@dataclass(frozen=True)
class State:
    """Where a holder starts: the stream's position (``None``: from now), and the scan to run
    first, if one is due (its ``epoch``, and ``after``: the last ``_id`` it published for)."""

    token: Doc | None
    scan: Doc | None

    @classmethod
    def of(cls, doc: Mapping[str, Any]) -> State:
        """Read from a follower's document of any shape."""
        token = doc.get("token")
        scan = doc.get("scan")
        due = isinstance(scan, dict) and not scan.get("done") and isinstance(scan.get("epoch"), int)
        return cls(
            token=token if isinstance(token, dict) and token else None,
            scan=dict(scan) if due and isinstance(scan, dict) else None,
        )
