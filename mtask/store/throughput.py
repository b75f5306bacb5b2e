"""Finished and failed tasks per minute per name, kept in MongoDB for the dashboard's charts.

``mtask serve`` calls ``record`` for the chart's whole hour when it starts (the minutes before
it started are read from the tasks, not lost), then every few seconds: it counts, with the
``finished_at`` index, the tasks that finished in each of the last ``RECOUNT_MINUTES`` whole
minutes of the server's clock, grouped by name and status, and upserts one document per
(minute, name) into the ``throughput`` collection. Each upsert sets the counts outright, so
recording a minute again — by the same serve after a restart, or by two serves at once — gives
the same document. A TTL index drops minutes older than ``KEEP_SECONDS``, so the collection
stays small. (A task retried after it finished leaves the minute it finished in; the chart
counts tasks, as the counts do.)
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from pymongo import ASCENDING, IndexModel, UpdateOne

from mtask.driver import Call, Op

COLLECTION = "throughput"
KEEP_SECONDS = 24 * 3600
RECOUNT_MINUTES = 3
TASK_INDEXES = [
    # (finished_at, name): its own key pattern, so no other index on finished_at clashes with it
    IndexModel(
        [("finished_at", ASCENDING), ("name", ASCENDING)], name="mtask_throughput_finished_at"
    )
]
INDEXES = [
    IndexModel([("minute", ASCENDING)], name="ttl", expireAfterSeconds=KEEP_SECONDS),
]


def minute_of(when: dt.datetime) -> dt.datetime:
    return when.replace(second=0, microsecond=0)


def ensure_indexes() -> Op[None]:
    yield Call("create_indexes", (TASK_INDEXES,))
    yield Call("create_indexes", (INDEXES,), collection=COLLECTION)


def record(now: dt.datetime, minutes: int = RECOUNT_MINUTES) -> Op[int]:
    """Count the last ``minutes`` whole minutes again (a few, every few seconds; the chart's
    whole hour when ``mtask serve`` starts, so that it shows what finished before); returns how
    many (minute, name) rows were set."""
    end = minute_of(now)
    start = end - dt.timedelta(minutes=minutes)
    rows: list[dict[str, Any]] = yield Call(
        "aggregate",
        (
            [
                {"$match": {"finished_at": {"$gte": start, "$lt": end}}},
                {
                    "$group": {
                        "_id": {
                            "minute": {"$dateTrunc": {"date": "$finished_at", "unit": "minute"}},
                            "name": "$name",
                        },
                        "finished": {"$sum": 1},
                        "failed": {"$sum": {"$cond": [{"$eq": ["$status", "failed"]}, 1, 0]}},
                    }
                },
            ],
        ),
    )
    writes = [
        UpdateOne(
            {"_id": f"{row['_id']['minute'].isoformat()}|{row['_id']['name']}"},
            {
                "$set": {
                    "minute": row["_id"]["minute"],
                    "name": str(row["_id"]["name"]),
                    "finished": row["finished"],
                    "failed": row["failed"],
                }
            },
            upsert=True,
        )
        for row in rows
    ]
    if writes:
        yield Call("bulk_write", (writes,), {"ordered": False}, collection=COLLECTION)
    return len(writes)


def recent(now: dt.datetime, minutes: int = 60) -> Op[list[dict[str, Any]]]:
    """The recorded rows of the last ``minutes`` minutes, oldest first."""
    since = minute_of(now) - dt.timedelta(minutes=minutes)
    docs: list[dict[str, Any]] = yield Call(
        "find",
        ({"minute": {"$gte": since}},),
        {"sort": [("minute", ASCENDING)]},
        collection=COLLECTION,
    )
    return docs


def runs_by_worker(now: dt.datetime, minutes: int = 60) -> Op[dict[str, dict[str, int]]]:
    """Runs each worker ended in the last ``minutes`` minutes — ``processed`` (SUCCESS, FAIL,
    TIMEOUT) and ``failed`` (FAIL, TIMEOUT) — read from the tasks that finished in that window
    (the ``finished_at`` index bounds the work; runs of tasks still open are not counted)."""
    since = now - dt.timedelta(minutes=minutes)
    ended = ["SUCCESS", "FAIL", "TIMEOUT"]
    rows: list[dict[str, Any]] = yield Call(
        "aggregate",
        (
            [
                {"$match": {"finished_at": {"$gte": since}}},
                {"$project": {"runs.worker_id": 1, "runs.state": 1, "runs.finished_at": 1}},
                {"$unwind": "$runs"},
                {"$match": {"runs.finished_at": {"$gte": since}, "runs.state": {"$in": ended}}},
                {
                    "$group": {
                        "_id": "$runs.worker_id",
                        "processed": {"$sum": 1},
                        "failed": {"$sum": {"$cond": [{"$eq": ["$runs.state", "SUCCESS"]}, 0, 1]}},
                    }
                },
            ],
        ),
    )
    return {str(r["_id"]): {"processed": r["processed"], "failed": r["failed"]} for r in rows}
