"""The audit of ``mtask serve``'s actions: a capped collection, ``audit``, of who did what,
when and from where (newest last; the oldest go first once it is full).

A record: ``at`` (the server's time), ``who`` and ``role`` (the token's), ``action`` (``retry``,
``purge``, …), ``target`` (the task, name, worker or filter), ``method`` and ``path``,
``status`` (the answer's: a refused attempt is recorded too), ``from`` (the client's address)
and ``via`` (``api`` or ``dashboard``).
"""

from __future__ import annotations

from typing import Any

from bson import ObjectId
from pymongo.errors import OperationFailure

from mtask.driver import Call, Doc, Op

COLLECTION = "audit"
BYTES = 32 * 1024 * 1024
MAX_RECORDS = 100_000
NAMESPACE_EXISTS = 48


def ensure() -> Op[None]:
    """The capped collection, made if missing (serve makes it at start)."""
    try:
        yield Call(
            "command",
            ("create", COLLECTION),
            {"capped": True, "size": BYTES, "max": MAX_RECORDS},
            collection=COLLECTION,
        )
    except OperationFailure as exc:
        if exc.code != NAMESPACE_EXISTS:
            raise


def record(entry: Doc) -> Op[None]:
    yield Call("insert_one", (entry,), collection=COLLECTION)


def recent(limit: int = 100, before: str | None = None) -> Op[list[Doc]]:
    """The newest records first, ``limit`` of them, older than the record ``before`` (its
    ``id``, for the next page)."""
    query: dict[str, Any] = {}
    if before is not None and ObjectId.is_valid(before):
        query["_id"] = {"$lt": ObjectId(before)}
    found: list[Doc] = yield Call(
        "find", (query,), {"sort": [("_id", -1)], "limit": limit}, collection=COLLECTION
    )
    return [{**{k: v for k, v in d.items() if k != "_id"}, "id": str(d["_id"])} for d in found]
