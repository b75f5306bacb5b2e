"""A trigger's writes (docs/triggers.md): the tasks its changes publish, and its scan's reads.

A trigger keyed by change publishes with ``store.publish_many`` (insert-if-absent by key: a
change handed out again finds its task there). A trigger keyed by document publishes each
change with ``publish_document``, whose rules keep one task waiting per document and lose no
change:

1. no task for the document: it is created (``run_at``: the debounce's end);
2. the document's task has not started (pending, never claimed): the change *joins* it (its
   params become this change's, its start moves to the debounce's end, never earlier);
3. it finished: it is reset and runs again (``on_conflict="reset"``);
4. it has started (running, or pending again after a run: a retry, a durable wait): a
   *follow-up* task keyed by that run (``<key>:after-<run digest>``) is created, or joined if it
   has not started; a change that finds the follow-up started too gets a task of its own
   (keyed by the change). So every change is seen by a run that starts after it.
"""

from __future__ import annotations

import datetime as dt
import hashlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

from pymongo import ASCENDING

from mtask.connection.clients import CODEC_OPTIONS
from mtask.driver import Call, Doc, Op
from mtask.statemachine import recompute_stages
from mtask.store.schema import literal
from mtask.store.tasks import FINISHED, Published, publish
from mtask.vocabulary import TaskStatus

if TYPE_CHECKING:
    from mtask.models import NewTask

Outcome = Literal["created", "joined", "reset", "follow-up", "own"]


def join(task: NewTask, now: dt.datetime, run_at: dt.datetime | None) -> Op[bool]:
    """The change joins the document's task if it has not started: its params replaced, its
    start moved to ``run_at`` if that is later (the debounce)."""
    sets: Doc = {"params": literal(task.params), "updated_at": now}
    if run_at is not None:
        sets["available_at"] = {"$max": ["$available_at", run_at]}
    result = yield Call(
        "update_one",
        (
            {"_id": task.key, "status": TaskStatus.PENDING.value, "attempts": 0},
            [{"$set": sets}, *recompute_stages(now)],
        ),
    )
    return bool(result.matched_count)


def _started(doc: Mapping[str, Any]) -> bool:
    """A task that a run began (its params were read): a change must come after it."""
    return doc.get("status") == TaskStatus.RUNNING.value or bool(doc.get("attempts"))


def _last_run(doc: Mapping[str, Any]) -> str:
    runs = doc.get("runs")
    last = runs[-1] if isinstance(runs, list) and runs else {}
    run_id = last.get("run_id") if isinstance(last, dict) else None
    return str(run_id) if run_id is not None else str(doc.get("attempts"))


def follow_up_key(key: str, run_id: str) -> str:
    """The key of the task for the changes made while (or after) run ``run_id`` ran."""
    return f"{key}:after-{hashlib.blake2b(run_id.encode(), digest_size=8).hexdigest()}"


def publish_document(
    task: NewTask,
    own: NewTask,
    now: dt.datetime,
    run_at: dt.datetime | None,
    retention: Mapping[str, Doc] | None = None,
) -> Op[Outcome]:
    """Publish the change ``task`` (keyed by its document) by the rules above; ``own`` is the
    same task keyed by the change, for a change that neither the document's task nor its
    follow-up can take."""
    published: Published = yield from publish(task, now, "ignore", retention=retention)
    if published.created:
        return "created"
    if published.document.get("status") in FINISHED:
        published = yield from publish(task, now, "reset", retention=retention)
        if published.updated or published.created:
            return "reset"
    elif not _started(published.document) and (yield from join(task, now, run_at)):
        return "joined"
    key = follow_up_key(task.key, _last_run(published.document))
    follow = task.model_copy(update={"key": key})
    published = yield from publish(follow, now, "ignore", retention=retention)
    if published.created:
        return "follow-up"
    if not _started(published.document) and (yield from join(follow, now, run_at)):
        return "joined"
    yield from publish(own, now, "ignore", retention=retention)
    return "own"


def scan_page(
    collection: str, filt: Doc, projection: Doc, after: Any, first: bool, limit: int
) -> Op[list[Doc]]:
    """A page of the documents of ``collection`` a scan publishes for, in ``_id`` order from
    ``after`` on (``first``: from the start). The bound is the ``_id`` index's ``min``, which
    orders ``_id``s of every type as the index does (a ``$gt`` compares within one type)."""
    size = limit + (0 if first else 1)
    command: Doc = {
        "find": collection,
        "filter": filt,
        "projection": projection,
        "sort": {"_id": ASCENDING},
        "limit": size,
        "batchSize": size,
        "singleBatch": True,
    }
    if not first:
        command.update(hint={"_id": ASCENDING}, min={"_id": after})
    reply: Doc = yield Call("command", (command,), {"codec_options": CODEC_OPTIONS})
    docs: list[Doc] = reply.get("cursor", {}).get("firstBatch") or []
    if not first and docs and docs[0].get("_id") == after:
        docs = docs[1:]
    return docs[:limit]
