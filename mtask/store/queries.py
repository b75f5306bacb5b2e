"""Read-only questions an operator asks of a large collection, each answered from an index
(tests/integration/test_indexes.py checks each plan with ``explain``): recently finished tasks,
all runs of a worker, delayed tasks, and error text. Counts per name and status are
``store/counts.py``."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import Any

from pymongo import ASCENDING, DESCENDING
from pymongo.errors import OperationFailure

from mtask.driver import Call, Doc, Op
from mtask.explain.states import held_ends
from mtask.statemachine import OPEN, RUNNING
from mtask.store import cluster, counts
from mtask.store.bulk import ERROR_TEXT
from mtask.store.schedules import next_due

INDEX_NOT_FOUND = 27
"""The server's code for a ``$text`` query on a collection without a text index."""
SUMMARY = {"name": 1, "status": 1, "created_at": 1, "finished_at": 1, "next_claim_at": 1}


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
    """Tasks with a (kept) run by ``worker_id``, on the multikey ``runs_worker`` index: one of
    ``schema.OPERATOR_INDEXES``, made on request only (``mtask collection init
    --operator-indexes``); without it the query reads every task."""
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
    (``counts.names``), then ``delayed_find``. No index of its own: an index on
    ``next_claim_at`` alone would move a key on every claim and finish (W1 pays for it)."""
    names: list[Any] = yield counts.names()
    names = [n for n in names if isinstance(n, str)]
    if not names:
        return []
    docs: list[Doc] = yield delayed_find(names, now, limit)
    return docs


def with_error(words: str, limit: int = 100) -> Op[list[Doc]]:
    """Tasks whose last error contains all of ``words`` (whole words, no stemming: the
    ``error_text`` text index with language ``none``), best match first. Where that index is
    not there yet, the first search makes it and asks again (no index is asked for on every
    call: a search costs its one find)."""
    search = " ".join(f'"{w}"' for w in words.replace('"', " ").split())
    find = Call(
        "find",
        ({"$text": {"$search": search}, "error": {"$type": "string"}}, {**SUMMARY, "error": 1}),
        {"limit": limit},
    )
    try:
        docs: list[Doc] = yield find
    except OperationFailure as exc:
        if exc.code != INDEX_NOT_FOUND:
            raise
        yield Call("create_indexes", ([ERROR_TEXT],))
        docs = yield find
    return docs


def finished_since(since: dt.datetime) -> Op[dict[str, int]]:
    """Per name, the tasks that finished after ``since`` (the ``finished`` index: the cost is
    what finished since then, not what the collection keeps). For rates, as ``mtask top``'s."""
    rows: list[Doc] = yield Call(
        "aggregate",
        (
            [
                {"$match": {"finished_at": {"$type": "date", "$gt": since}}},
                {"$group": {"_id": "$name", "n": {"$sum": 1}}},
            ],
        ),
        {"hint": "finished"},
    )
    return {str(row["_id"]): int(row["n"]) for row in rows}


def quiet_until(now: dt.datetime) -> Op[tuple[bool, dt.datetime | None]]:
    """Whether nothing is to do at ``now`` (no open task with a RUNNING run, none claimable by
    ``now``), and the earliest time something will be: the soonest ``next_claim_at`` of an open
    task and ``next_tick_at`` of a schedule (``None``: nothing is waiting for a time, only for
    a signal, data or nothing). A due task held back (a back-off, a full limit or token window,
    as ``explain`` says: ``held_ends``) is not claimable: then the earliest is the soonest end
    of what holds the due tasks, if sooner. For ``mtask.testing``'s automatic skips; the sorted
    find reads the open tasks (no index orders them by ``next_claim_at`` alone: see
    ``delayed``)."""
    running = yield Call(
        "find_one", ({"status": {"$in": list(OPEN)}, "runs.state": RUNNING}, {"_id": 1})
    )
    soonest = yield Call(
        "find_one",
        ({"status": {"$in": list(OPEN)}, "next_claim_at": {"$type": "date"}}, SUMMARY),
        {"sort": [("next_claim_at", ASCENDING)]},
    )
    tick: dt.datetime | None = yield from next_due()
    at = None if soonest is None else soonest["next_claim_at"]
    soonest_at = min([t for t in (at, tick) if isinstance(t, dt.datetime)], default=None)
    if running is not None or soonest_at is None or soonest_at > now:
        return running is None, soonest_at
    if tick is not None and tick <= now:
        return False, soonest_at
    ends = yield from held_due_ends(now)
    return ends is not None, soonest_at if ends is None else min([ends, *([tick] if tick else [])])


HELD_READ = 100
"""How many due tasks ``held_due_ends`` reads (more due at once: not quiet)."""


def held_due_ends(now: dt.datetime) -> Op[dt.datetime | None]:
    """If every open task due by ``now`` is held back by something that ends by time, the
    soonest of those ends or of the next ``next_claim_at`` after ``now`` (``None``: some due
    task is claimable, or held by what no time ends)."""
    from mtask.models import Task

    due: list[Doc] = yield Call(
        "find",
        ({"status": {"$in": list(OPEN)}, "next_claim_at": {"$lte": now}},),
        {"limit": HELD_READ + 1},
    )
    if not due or len(due) > HELD_READ:
        return None
    tasks = [Task.from_document(d) for d in due]
    facts = yield from cluster.read(tasks, now)
    ends = [held_ends(t, facts) for t in tasks]
    if any(e is None for e in ends):
        return None
    later = yield Call(
        "find_one",
        ({"status": {"$in": list(OPEN)}, "next_claim_at": {"$gt": now}}, SUMMARY),
        {"sort": [("next_claim_at", ASCENDING)]},
    )
    found = [e for e in ends if e is not None]
    if later is not None and isinstance(later.get("next_claim_at"), dt.datetime):
        found.append(later["next_claim_at"])
    return min(found)
