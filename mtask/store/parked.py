"""The parked tasks a preflight reads (``mtask.steps.preflight``): pending tasks with a
journal, page by page from the ``name_status_newest`` index, only the fields a dry replay
needs, and the results they keep aside. Reads only: a preflight writes nothing."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from mtask.driver import Call, Doc, Op
from mtask.store import steps as store_steps
from mtask.vocabulary import TaskStatus

PAGE = 1000
STEP_FIELDS = (
    "name", "kind", "state", "attempts", "result", "spill", "group", "until", "signal", "nth",
    "total", "failed", "failures",
)  # fmt: skip
"""What a dry replay reads of each recorded step (not its tries, nor who ran it when)."""


def page(name: str, after: tuple[Any, Any] | None, limit: int = PAGE) -> Op[list[Doc]]:
    """A page of ``name``'s parked tasks (pending, with a journal), newest first, after the
    ``(created_at, _id)`` of the previous page's last."""
    filt: Doc = {"name": name, "status": TaskStatus.PENDING.value, "steps.0": {"$exists": True}}
    if after is not None:
        created, key = after
        filt["$or"] = [
            {"created_at": {"$lt": created}},
            {"created_at": created, "_id": {"$lt": key}},
        ]
    fields = {"name": 1, "params": 1, "attempts": 1, "updated_at": 1, "created_at": 1}
    fields.update({f"steps.{f}": 1 for f in STEP_FIELDS})
    docs: list[Doc] = yield Call(
        "find",
        (filt, fields),
        {"sort": [("created_at", -1), ("_id", -1)], "limit": limit, "hint": "name_status_newest"},
    )
    return docs


def spills(docs: Iterable[Doc]) -> Op[None]:
    """The results the tasks keep aside (a result over 16 KiB: rare), into each one's
    ``_spills`` by reference, for the replay to give back."""
    for doc in docs:
        for step in doc.get("steps") or []:
            ref = step.get("spill") if isinstance(step, dict) else None
            if isinstance(ref, dict):
                data = yield from store_steps.load(str(doc["_id"]), ref)
                doc.setdefault("_spills", {})[str(ref.get("id"))] = data


def parked(name: str, after: tuple[Any, Any] | None, limit: int = PAGE) -> Op[list[Doc]]:
    """A page of ``name``'s parked tasks with the results they keep aside (``page``,
    ``spills``)."""
    found: list[Doc] = yield from page(name, after, limit)
    yield from spills(found)
    return found
