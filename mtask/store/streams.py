"""A follower's reads (``mtask.follow.streams.catch_up``): a task's status, and a page of its
stored output entries after a position, in ``seq`` order."""

from __future__ import annotations

from collections.abc import Sequence

from pymongo import ASCENDING

from mtask.driver import Call, Doc, Op
from mtask.store import output as store_output


def status_of(key: str) -> Op[Doc | None]:
    """The task's status (``None``: there is no such task)."""
    doc: Doc | None = yield Call("find_one", ({"_id": key}, {"status": 1}))
    return doc


def entries_after(key: str, last: int, kinds: Sequence[str] | None) -> Op[list[Doc]]:
    """At most ``store_output.MAX_READ`` of the task's entries after ``seq`` ``last``."""
    page: list[Doc] = yield Call(
        "find",
        (store_output.read_filter(key, last, kinds), {"_id": 0, "expire_at": 0}),
        {"sort": [("seq", ASCENDING)], "limit": store_output.MAX_READ},
        collection="output",
    )
    return page
