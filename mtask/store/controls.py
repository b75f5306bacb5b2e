"""Operations on the ``workers`` and ``controls`` collections: worker heartbeats and remote
stop, and pausing task names. Each is one MongoDB call, like the task operations."""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from typing import Any

from pymongo import ASCENDING

from mtask.driver import MODIFY_ONCE, Call, Doc, Op

BEAT_CONCERN = {"w": 1}
"""A heartbeat's write concern: the primary's acknowledgement. A heartbeat is a hint of who is
alive that the next one writes again within seconds, and no state of a task depends on it; a
majority write made the server flush its journal for each (docs/journal/2026-11.md,
"Heartbeats")."""


def heartbeat(info: Mapping[str, Any], now: dt.datetime) -> Op[Doc]:
    """Register or refresh a worker; returns its document (with ``stop_requested``, and the
    server's time of the write in ``beat_at``, which checks the worker's clock at no extra round
    trip: ``ServerClock.needs_calibration``). A plain ``findAndModify`` with ``BEAT_CONCERN``,
    not a retryable write: a beat that fails is written again by the next."""
    fields = {k: v for k, v in info.items() if k != "_id"}
    doc: Doc = yield Call(
        MODIFY_ONCE,
        (
            {"_id": info["_id"]},
            {
                "$set": {**fields, "last_seen": now},
                "$currentDate": {"beat_at": True},
                "$setOnInsert": {"stop_requested": False, "started_at": now},
            },
        ),
        {"upsert": True, "new": True, "writeConcern": BEAT_CONCERN},
        collection="workers",
    )
    return doc


def deregister(worker_id: str) -> Op[None]:
    yield Call("delete_one", ({"_id": worker_id},), collection="workers")


def live_workers(
    now: dt.datetime, within: dt.timedelta, fields: Mapping[str, int] | None = None
) -> Op[list[Doc]]:
    """Workers whose last heartbeat is more recent than ``within`` (only ``fields`` of them,
    if given: every worker reads its peers' names at each heartbeat, and N workers reading N
    whole documents each is N² of them)."""
    docs: list[Doc] = yield Call(
        "find",
        ({"last_seen": {"$gt": now - within}}, fields),
        {"sort": [("_id", ASCENDING)]},
        collection="workers",
    )
    return docs


def request_stop(worker_id: str) -> Op[bool]:
    """Ask a worker to drain and exit (it sees this at its next heartbeat)."""
    result = yield Call(
        "update_one",
        ({"_id": worker_id}, {"$set": {"stop_requested": True}}),
        collection="workers",
    )
    return bool(result.matched_count)


def set_paused(name: str, paused: bool, now: dt.datetime) -> Op[None]:
    """Pause or resume claiming of a task name across all workers."""
    yield Call(
        "update_one",
        ({"_id": name}, {"$set": {"paused": paused, "updated_at": now}}),
        {"upsert": True},
        collection="controls",
    )


def paused_names() -> Op[set[str]]:
    docs = yield Call("find", ({"paused": True}, {"_id": 1}), collection="controls")
    return {str(d["_id"]) for d in docs}
