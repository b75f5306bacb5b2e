"""Operations on many tasks at once: search with keyset pagination, and retry, cancel or purge
by filter — for the dashboard's task list and ``POST /tasks:retry`` / ``:cancel`` / ``:purge``.

A filter is ``{name, status, older_than, keys}`` (any may be absent). Each action narrows the
statuses to those it applies to *in the filter itself*: retry to failed/cancelled, cancel to
pending/running, purge to finished statuses — so a purge can never delete an open task, whatever
the caller asks. Retry and cancel run the single-task operations (``store.tasks.retry`` /
``store.children.cancel_tree``: a task's open children are cancelled with it) on each matching
key, with their own fences; a key whose state changed in between is
skipped. ``older_than`` compares ``updated_at`` (for a finished task, when it finished) with
the server's ``now``.

Search and list use the indexes of ``INDEXES`` (made by ``ensure_indexes`` when ``mtask serve``
starts, or by a client's first search by error text): name + newest first for a name's list,
and a text index on ``error`` for error search; a key prefix uses ``_id``'s own index.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pymongo import ASCENDING, DESCENDING, TEXT, IndexModel

from mtask.driver import Call, Doc, Op
from mtask.errors import InvalidTask, InvalidTransition, TaskNotFound
from mtask.store import across, children, counts, tasks
from mtask.vocabulary import (
    FINISHED_STATUSES,
    MAX_AGE_SECONDS,
    OPEN_STATUSES,
    UNENCODABLE,
    TaskStatus,
    encodable,
)

Action = Literal["retry", "cancel", "purge"]
MAX_PER_CALL = 1000
"""Retry and cancel change at most this many tasks per call (``truncated`` says more matched)."""
APPLIES: dict[str, tuple[str, ...]] = {
    "retry": (TaskStatus.FAILED.value, TaskStatus.CANCELLED.value),
    "cancel": OPEN_STATUSES,
    "purge": tuple(sorted(s.value for s in FINISHED_STATUSES)),
}
INDEXES = [
    IndexModel(
        [("name", ASCENDING), ("created_at", DESCENDING), ("_id", DESCENDING)],
        name="mtask_bulk_name_newest",
    ),
    # a group's tasks, newest first: only tasks with a group have keys
    IndexModel(
        [("options.group", ASCENDING), ("created_at", DESCENDING), ("_id", DESCENDING)],
        name="mtask_bulk_group_newest",
        partialFilterExpression={"options.group": {"$type": "string"}},
    ),
]
ERROR_TEXT = IndexModel(
    [("error", TEXT)],
    name="error_text",
    default_language="none",
    partialFilterExpression={"error": {"$type": "string"}},
)
"""Error words (``search(text=...)``, ``queries.with_error``): no stemming, so exception names
match exactly; partial, so only tasks with an error have keys. Made with the dashboard's
indexes or by the first search by error text, not by every worker: each index of the tasks
collection costs every claim and outcome its key generation (docs/scale.md, "Indexes for
operators"). A collection may hold one text index only."""
INDEXES.append(ERROR_TEXT)


@dataclass(frozen=True)
class Filter:
    name: str | None = None
    status: Sequence[str] | None = None
    older_than_s: float | None = None
    keys: Sequence[str] | None = None

    def __post_init__(self) -> None:
        """Refuse what no query can hold (``InvalidTask``), before anything is read or written:
        a lone surrogate in the name or a key, an age beyond ``MAX_AGE_SECONDS``, statuses or
        keys that are not a list (a string would be read as its characters)."""
        if isinstance(self.name, str) and not encodable(self.name):
            raise InvalidTask(UNENCODABLE, field="name")
        for field, values in (("status", self.status), ("keys", self.keys)):
            if values is not None and not isinstance(values, list | tuple):
                raise InvalidTask(f"must be a list, not {type(values).__name__}", field=field)
        for index, key in enumerate(self.keys or ()):
            if isinstance(key, str) and not encodable(key):
                raise InvalidTask(UNENCODABLE, field=f"keys[{index}]")
        age = self.older_than_s
        if age is not None and (
            not isinstance(age, int | float)
            or isinstance(age, bool)
            or not 0 <= age <= MAX_AGE_SECONDS  # also NaN
        ):
            raise InvalidTask(f"must be 0 to {MAX_AGE_SECONDS} seconds", field="older_than")

    @property
    def across_names(self) -> bool:
        """Whether the query is read name by name (``store.across``): it has no name and no
        keys (a status alone has no index)."""
        return self.name is None and self.keys is None

    def query(self, action: Action, now: dt.datetime, names: Sequence[Any] | None = None) -> Doc:
        """The MongoDB filter: this one, narrowed to the statuses ``action`` applies to;
        ``names``: the names present, for a filter ``across_names``."""
        allowed = [s for s in APPLIES[action] if not self.status or s in self.status]
        filt: Doc = {"status": {"$in": allowed}}
        if self.name is not None:
            filt["name"] = self.name
        elif names is not None:
            filt |= across.every_name(names)
        if self.older_than_s is not None:
            filt["updated_at"] = {"$lt": now - dt.timedelta(seconds=self.older_than_s)}
        if self.keys is not None:
            filt["_id"] = {"$in": list(self.keys)}
        return filt


@dataclass(frozen=True)
class BulkResult:
    action: Action
    dry_run: bool
    matched: int
    changed: int
    truncated: bool = False


def ensure_indexes() -> Op[None]:
    """The task list's and search's own indexes (named ``mtask_bulk_*``)."""
    yield Call("create_indexes", (INDEXES,))


def _query(action: Action, where: Filter, now: dt.datetime) -> Op[Doc]:
    """``where.query``, with the names present read first if it is ``across_names``."""
    if action not in APPLIES:
        raise InvalidTask(f"must be one of {', '.join(APPLIES)}, not {action!r}", field="action")
    names = (yield counts.names()) if where.across_names else None
    return where.query(action, now, names)


def count(action: Action, where: Filter, now: dt.datetime, limit: int) -> Op[int]:
    """How many tasks ``action`` would change, counting at most ``limit + 1`` (the ``count``
    command stops there): a page that offers "purge all" must not walk a million keys to say
    how many. More than ``limit`` comes back as ``limit + 1``."""
    n: int = yield Call("count", ((yield from _query(action, where, now)),), {"limit": limit + 1})
    return n


def apply(action: Action, where: Filter, now: dt.datetime, dry_run: bool) -> Op[BulkResult]:
    filt = yield from _query(action, where, now)
    matched: int = yield Call("count_documents", (filt,))
    if dry_run or matched == 0:
        return BulkResult(action, dry_run, matched, 0)
    if action == "purge":
        result = yield Call("delete_many", (filt,))
        return BulkResult(action, False, matched, int(result.deleted_count))
    docs = yield Call(
        "find", (filt, {"_id": 1}), {"sort": [("_id", ASCENDING)], "limit": MAX_PER_CALL}
    )
    one = tasks.retry if action == "retry" else children.cancel_tree  # and its children
    changed = 0
    for doc in docs:
        try:
            yield from one(doc["_id"], now)
        except (InvalidTransition, TaskNotFound):
            continue  # its state changed since the count: not ours to change any more
        changed += 1
    return BulkResult(action, False, matched, changed, truncated=matched > MAX_PER_CALL)


def search_query(
    name: str | None,
    status: str | None,
    prefix: str | None,
    text: str | None,
    group: str | None = None,
    where: Doc | None = None,
    parent: str | None = None,
) -> tuple[Doc, list[tuple[str, int]]]:
    """A search's filter and order (read name by name if ``search_across_names``); ``where``:
    a filter the tasks must also match (``store.cluster.candidates``); ``parent``: the tasks
    below that one (its spawned children and next steps), oldest first as they were made (the
    ``parent`` index)."""
    for field, value in (("prefix", prefix), ("q", text)):
        if value and "\x00" in value:  # the server refuses it in a pattern (a 500 otherwise)
            raise InvalidTask("must not contain a NUL character", field=field)
    filt, sort = tasks.list_query(name, status)
    if group is not None:  # as the partial index spells it, so that the server uses it
        filt["options.group"] = {"$eq": group, "$type": "string"}
    if parent is not None:
        filt["parent"] = parent
        sort = [("created_at", ASCENDING), ("_id", ASCENDING)]
    if prefix:  # key order, so that _id's index serves both the prefix and the order
        filt["_id"] = {"$regex": f"^{re.escape(prefix)}"}
        sort = [("_id", ASCENDING)]
    if text:  # the partial error_text index: the query carries its predicate
        filt["$text"] = {"$search": text}
        filt["error"] = {"$type": "string"}
    if where:
        filt["$and"] = [where]
    return filt, sort


def search_across_names(
    name: str | None,
    status: str | None,
    prefix: str | None,
    text: str | None,
    parent: str | None = None,
) -> bool:
    """Whether a search is read name by name (``store.across``): by status without a name,
    and neither by key prefix, by error text nor by parent (which have indexes of their own)."""
    return tasks.across_names(name, status) and not prefix and not text and parent is None


def search(
    name: str | None = None,
    status: str | None = None,
    prefix: str | None = None,
    text: str | None = None,
    after: str | None = None,
    limit: int = 50,
    group: str | None = None,
    where: Doc | None = None,
    parent: str | None = None,
) -> Op[list[Doc]]:
    """A page of tasks, newest first (in key order with a key ``prefix``, oldest first below a
    ``parent``), matching all the filters given (``where``: a filter of its own too);
    ``after`` is the last key of the previous page (keyset pagination: every page costs the
    same)."""
    if not isinstance(limit, int) or isinstance(limit, bool) or not 1 <= limit <= 1000:
        raise InvalidTask(f"is {limit}; 1 to 1000", field="limit")
    filt, sort = search_query(name, status, prefix, text, group, where, parent)
    if after is not None and sort[0][0] == "_id":
        filt = {"$and": [filt, {"_id": {"$gt": after}}]}
    elif after is not None:
        anchor = yield Call("find_one", ({"_id": after}, {"created_at": 1}))
        if anchor is None:
            raise TaskNotFound(after)
        value = anchor.get("created_at")
        beyond = "$gt" if sort[0][1] == ASCENDING else "$lt"
        filt["$or"] = [
            {"created_at": {beyond: value}},
            {"created_at": value, "_id": {beyond: after}},
        ]
    by_name = search_across_names(name, status, prefix, text, parent)
    return (yield from across.find_page(filt, sort, limit, by_name))
