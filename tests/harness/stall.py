"""What a stalled queue looks like, for the message of a wait that timed out (``until_finished``'s
``explain``): the open tasks, the server's time, the limits, the relay's lease, the workers'
heartbeats, and the end of each worker's log. Each part is read on its own, within a few
seconds: one that fails (MongoDB failing over, a log gone) says so in its place."""

from __future__ import annotations

import datetime as dt
import functools
import re
from collections.abc import Callable, Mapping
from typing import Any

import pymongo
from bson import json_util
from pymongo.database import Database

LIMIT = 60_000
"""The most characters of a report (a CI log keeps all of it, and a reader can still scroll)."""
READ_WITHIN = 5.0
"""How long each part may take to read from MongoDB (a server that does not answer: the report
says so rather than hanging the failing test until its own timeout)."""
OPEN_TASKS = 20
"""The most open tasks shown (running first, then the oldest), and documents of ``limits``,
``relays`` and ``workers``."""
LAST_RUNS = 3
"""The runs of a task shown: its last ones (and how many it has)."""
TRIMMED = ("params", "args", "result", "error", "output")
"""Fields cut to ``FIELD_CHARS`` (in a task and in each of its runs)."""
FIELD_CHARS = 200
DOC_CHARS = 3000
"""The most characters of one document of ``limits`` (its holders may be many)."""
TAIL_LINES = 60
NOTABLE = re.compile(r"relay|left|slow|silent|lost|stop|Traceback|ERROR|WARNING")
"""The lines of a worker's whole log worth seeing beside its tail (the last ``NOTABLE_LINES``)."""
NOTABLE_LINES = 40
LINE_CHARS = 400


def dumps(doc: Any) -> str:
    return json_util.dumps(doc, json_options=json_util.RELAXED_JSON_OPTIONS)


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else f"{text[:limit]}… [{len(text) - limit} more chars]"


def _trim(doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` with its bulky fields (``TRIMMED``) cut to their first characters, as text."""
    out = dict(doc)
    for field in TRIMMED:
        if field in out and out[field] is not None:
            text = dumps(out[field])
            if len(text) > FIELD_CHARS:
                out[field] = _cut(text, FIELD_CHARS)
    return out


def _part(title: str, read: Callable[[], str]) -> str:
    """``read``'s text under ``title``; what it raised instead if it failed."""
    try:
        with pymongo.timeout(READ_WITHIN):
            body = read()
    except Exception as exc:  # noqa: BLE001 - a report of a failure must not fail
        body = f"{UNREAD} {type(exc).__name__}: {_cut(str(exc), 500)})"
    return f"=== {title}\n{body}"


UNREAD = "(could not read:"


def open_tasks(db: Database[Any], tasks: str = "tasks", budget: int = LIMIT // 3) -> str:
    """The open tasks (pending or running), the running ones first, then the oldest, at most
    ``OPEN_TASKS`` of them in about ``budget`` characters, each in full but for its runs (the
    last ``LAST_RUNS``, and ``runs_total``) and bulky fields (``TRIMMED``)."""
    open_ = {"status": {"$in": ["pending", "running"]}}
    total = db[tasks].count_documents(open_)
    docs = db[tasks].aggregate(
        [
            {"$match": open_},
            {"$sort": {"status": -1, "created_at": 1, "_id": 1}},
            {"$limit": OPEN_TASKS},
            {
                "$addFields": {
                    "runs_total": {"$size": {"$ifNull": ["$runs", []]}},
                    "runs": {"$slice": [{"$ifNull": ["$runs", []]}, -LAST_RUNS]},
                }
            },
        ]
    )
    lines: list[str] = []
    for doc in docs:
        doc = _trim(doc)
        doc["runs"] = [_trim(run) if isinstance(run, dict) else run for run in doc["runs"]]
        text = dumps(doc)
        budget -= len(text) + 1
        if budget < 0 and lines:
            break
        lines.append(text)
    return "\n".join([f"{total} open task(s) in {tasks!r}, {len(lines)} shown:", *lines])


def server_time(db: Database[Any]) -> str:
    server = db.command("hello")["localTime"]
    if server.tzinfo is None:
        server = server.replace(tzinfo=dt.UTC)
    here = dt.datetime.now(dt.UTC)
    ahead = (here - server).total_seconds()
    return f"server: {server.isoformat()}  this host: {here.isoformat()} ({ahead:+.3f} s)"


def documents(db: Database[Any], collection: str, projection: Any = None) -> str:
    """The first ``OPEN_TASKS`` documents of ``collection``, one a line (each at most
    ``DOC_CHARS`` characters)."""
    docs = list(db[collection].find({}, projection).sort("_id", 1).limit(OPEN_TASKS + 1))
    more = " (and more)" if len(docs) > OPEN_TASKS else ""
    lines = [_cut(dumps(doc), DOC_CHARS) for doc in docs[:OPEN_TASKS]]
    return "\n".join([f"{len(lines)} document(s){more}", *lines])


HEARTBEAT = {
    "state": 1,
    "in_flight": 1,
    "last_seen": 1,
    "beat_at": 1,
    "stop_requested": 1,
    "stream": 1,
}
"""What a worker's heartbeat shows in a report: whether it beats, what it runs, and what it does
with the shared stream (``stream``, with ``relay`` in it if it holds the relay)."""


def worker_log(text: str, budget: int) -> str:
    """The end of a worker's log (``TAIL_LINES``) and, before it, its ``NOTABLE`` lines (the
    last ``NOTABLE_LINES``), in about ``budget`` characters at most: the earliest lines of each
    go first."""
    lines = [_cut(line, LINE_CHARS) for line in text.splitlines()]
    tail = lines[-TAIL_LINES:]
    notable = [line for line in lines[: -len(tail) or None] if NOTABLE.search(line)]
    out = [f"{len(lines)} line(s)"]
    for title, chosen in (
        (f"notable lines before the last {len(tail)}", notable[-NOTABLE_LINES:]),
        (f"the last {len(tail)} lines", tail),
    ):
        kept: list[str] = []
        size = 0
        for line in reversed(chosen):
            size += len(line) + 1
            if size > budget // 2:
                break
            kept.append(line)
        cut = len(chosen) - len(kept)
        out += [f"-- {title} ({len(kept)}{f', {cut} more cut' if cut else ''}):", *kept[::-1]]
    return "\n".join(out)


def _log_part(read: Callable[[], str], budget: int) -> str:
    return worker_log(read(), budget)


def stall_report(
    db: Database[Any],
    tasks: str = "tasks",
    logs: Mapping[str, Callable[[], str]] | None = None,
    limit: int = LIMIT,
) -> str:
    """A report of what the queue in ``db`` (its tasks in ``tasks``) is at: see the module.
    ``logs``: per worker (a title: its id, what its process is at), a reader of its log."""
    reads: list[tuple[str, Callable[[], str]]] = [
        ("server time", lambda: server_time(db)),
        ("open tasks", lambda: open_tasks(db, tasks, limit // 3)),
        ("limits", lambda: _cut(documents(db, "limits"), limit // 10)),
        ("relays (the shared stream's lease)", lambda: documents(db, "relays")),
        ("workers (heartbeats)", lambda: _cut(documents(db, "workers", HEARTBEAT), 8000)),
    ]
    parts: list[str] = []
    for title, read in reads:
        if parts and UNREAD in parts[0]:  # MongoDB does not answer: the logs without waiting
            parts.append(f"=== {title}\n(not read: MongoDB did not answer above)")
        else:
            parts.append(_part(title, read))
    logs = logs or {}
    left = limit - sum(len(p) + 1 for p in parts)
    budget = max(left // max(len(logs), 1) - 200, 1000)
    for title, read in logs.items():
        parts.append(_part(f"log of worker {title}", functools.partial(_log_part, read, budget)))
    return _cut("\n".join(parts), limit)
