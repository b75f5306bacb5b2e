"""Read-only questions an operator asks of a large collection, each answered from an index
(tests/integration/test_indexes.py checks each plan with ``explain``): counts per name and status
(``stats``), recently finished tasks, all runs of a worker, delayed tasks, and error text."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import Any

from pymongo import ASCENDING, DESCENDING

from mtask.driver import Call, Doc, Op
from mtask.models import TaskStatus

STATUSES = [s.value for s in TaskStatus]
STATS_INDEX = "name_status_newest"
"""Counts are ``COUNT_SCAN``s of this index's (name, status) prefix."""
INCOMPLETE = "incomplete"
"""How ``stats`` counts documents without a status (published by hand, not completed yet)."""
SUMMARY = {"name": 1, "status": 1, "created_at": 1, "finished_at": 1, "next_claim_at": 1}


def stats_names() -> Call:
    return Call("distinct", ("name",))  # a DISTINCT_SCAN (distinct takes no hint before 7.1)


def stats_count(name: Any, status: str) -> Call:
    return Call("count_documents", ({"name": name, "status": status},), {"hint": STATS_INDEX})


def stats(statuses: Sequence[str] | None = None) -> Op[dict[str, dict[str, int]]]:
    """Counts per name and status, from the ``name_status_newest`` index alone: the names by a
    ``DISTINCT_SCAN``, then one ``COUNT_SCAN`` per name and status (no document is read, no
    collection is scanned). Each count walks the index keys it counts, so its cost grows with
    the number of tasks kept (docs/performance.md, "Stats at scale": retention bounds it).
    With ``statuses``
    (e.g. ``statemachine.OPEN``), only those are counted: open tasks cost what the backlog
    costs, however many finished ones are kept."""
    names: list[Any] = yield stats_names()
    out: dict[str, dict[str, int]] = {}
    for name in sorted(names, key=str):
        for status in statuses or STATUSES:
            count: int = yield stats_count(name, status)
            if count:
                out.setdefault(str(name), {})[status] = count
        if statuses is None:  # a publisher's document that no worker has completed yet
            count = yield Call(
                "count_documents", ({"name": name, "status": None},), {"hint": STATS_INDEX}
            )
            if count:
                out.setdefault(str(name), {})[INCOMPLETE] = count
    return out


def recently_finished(limit: int = 100, name: str | None = None) -> Op[list[Doc]]:
    """The most recently finished tasks, newest first (the ``finished`` index)."""
    filt: Doc = {"finished_at": {"$type": "date"}}
    if name is not None:
        filt["name"] = name
    docs: list[Doc] = yield Call(
        "find",
        (filt, SUMMARY),
        {"sort": [("finished_at", DESCENDING), ("_id", DESCENDING)], "limit": limit},
    )
    return docs


def runs_by_worker(worker_id: str, limit: int = 100) -> Op[list[Doc]]:
    """Tasks with a (kept) run by ``worker_id`` (the multikey ``worker_runs`` index)."""
    docs: list[Doc] = yield Call(
        "find",
        (
            {"runs.worker_id": worker_id},
            {**SUMMARY, "runs": {"$elemMatch": {"worker_id": worker_id}}},
        ),
        {"limit": limit},
    )
    return docs


def delayed_find(names: Sequence[Any], now: dt.datetime, limit: int) -> Call:
    """The ``find`` of ``delayed``: one branch per name on the ``claim`` index (``name,
    next_claim_at, _id``, open tasks only), merged in claim-time order (``SORT_MERGE``)."""
    later = {"$type": "date", "$gt": now}
    return Call(
        "find",
        ({"$or": [{"name": name, "next_claim_at": later} for name in names]}, SUMMARY),
        {"sort": [("next_claim_at", ASCENDING), ("_id", ASCENDING)], "limit": limit},
    )


def delayed(now: dt.datetime, limit: int = 100) -> Op[list[Doc]]:
    """Open tasks not claimable before a later time, of any name, soonest first: the names
    (``stats_names``), then ``delayed_find``. No index of its own: an index on
    ``next_claim_at`` alone would move a key on every claim and finish (W1 pays for it)."""
    names: list[Any] = yield stats_names()
    names = [n for n in names if isinstance(n, str)]
    if not names:
        return []
    docs: list[Doc] = yield delayed_find(names, now, limit)
    return docs


def with_error(words: str, limit: int = 100) -> Op[list[Doc]]:
    """Tasks whose last error contains all of ``words`` (whole words, no stemming: the
    ``error_text`` text index with language ``none``), best match first."""
    search = " ".join(f'"{w}"' for w in words.replace('"', " ").split())
    docs: list[Doc] = yield Call(
        "find",
        ({"$text": {"$search": search}, "error": {"$type": "string"}}, {**SUMMARY, "error": 1}),
        {"limit": limit},
    )
    return docs
