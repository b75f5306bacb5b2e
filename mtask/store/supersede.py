"""Supersede: of the tasks of one name and group published with a policy, one open
task at a time, decided by a unique index, so racing publishers cannot both win.

A task published with ``supersede=<policy>`` stores the policy in ``supersede``; the unique
partial index ``supersede`` on ``(name, options.group)`` holds the open (pending or running)
ones, so at most one open task of a name and group holds it. A newer publish's insert is
refused by the index while an older one is open, and the newer's policy says what follows:

- ``drop_newer``: the newer is not stored; the older keeps its place;
- ``cancel_queued``: a pending older is cancelled (``superseded_by`` names the newer) and the
  insert tried again; a running older is left running and leaves the index (its ``supersede``
  unset, fenced by its status), so the newer queues behind it;
- ``cancel_running``: the older is cancelled, pending or running: a running handler is told at
  its next ping (``ctx.cancelled``) and its lease is fenced (the ping and every outcome match
  only an open task), as any cancel.

Each step is one atomic write whose filter proves what it changes (the holder still open and
holding); a racer whose write matched nothing reads the holder again. Every round either
inserts or ends an older holder, so each publisher ends within a few rounds of the racers. A
finished or cancelled task leaves the index by its status: nothing has to give the place up.
A task published without a policy is not in the index and is never superseded.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from pymongo.errors import DuplicateKeyError

from mtask.driver import Call, Doc, Op
from mtask.errors import InvalidTask, StorageError
from mtask.statemachine import OPEN
from mtask.store.retention import resolve
from mtask.store.schema import OPEN_LIST, WELL_FORMED, new_document
from mtask.store.tasks import cancel_pipeline
from mtask.vocabulary import TaskStatus

if TYPE_CHECKING:
    from mtask.models import NewTask

Policy = Literal["drop_newer", "cancel_queued", "cancel_running"]
POLICIES: tuple[str, ...] = ("drop_newer", "cancel_queued", "cancel_running")
FIELD = "supersede"
BY = "superseded_by"
INDEX = "supersede"
MAX_ROUNDS = 200
"""A bound no publisher reaches (each round inserts or ends one older holder, and a racer is
one of a finite number): past it the publish says so instead of spinning."""


def check_policy(policy: object) -> Policy:
    """``policy``, or ``InvalidTask`` naming the choices."""
    if policy not in POLICIES:
        raise InvalidTask(f"must be one of {', '.join(POLICIES)}, not {policy!r}", field=FIELD)
    return policy  # type: ignore[return-value]


@dataclass(frozen=True)
class Superseding:
    """What a superseding publish did: ``created`` its task; ``document`` that task, the one
    with its key that was there, or (dropped) the older task that kept its place;
    ``superseded`` the older tasks it cancelled; ``dropped`` True when the newer was not
    stored (``drop_newer``)."""

    created: bool
    document: Doc
    superseded: list[str] = field(default_factory=list)
    dropped: bool = False


def _holder_filter(name: str, group: str | None) -> Doc:
    return {
        "name": name,
        "options.group": group,
        FIELD: {"$type": "string"},
        "status": {"$in": OPEN_LIST},
    }


def publish_task(
    task: NewTask,
    policy: Policy,
    now: dt.datetime,
    trace: dict[str, str] | None = None,
    retention: Mapping[str, Doc] | None = None,
) -> Op[Superseding]:
    """``store.publish``'s document (retention resolved, ``trace`` kept), published under
    ``policy``."""
    task = (yield from resolve([task], retention))[0]
    doc = new_document(task, now)
    if trace:
        doc["trace"] = trace
    return (yield from publish(doc, policy, now))


def publish(doc: Doc, policy: Policy, now: dt.datetime) -> Op[Superseding]:
    """Insert ``doc`` (a new task document) under ``policy`` (module doc)."""
    doc = {**doc, FIELD: policy}
    name, group = doc["name"], (doc.get("options") or {}).get("group")
    superseded: list[str] = []
    for _ in range(MAX_ROUNDS):
        try:
            yield Call("insert_one", (doc,))
            return Superseding(True, doc, superseded)
        except DuplicateKeyError as exc:
            pattern = (exc.details or {}).get("keyPattern") or {}
            if "_id" in pattern:  # the key exists: publishing is idempotent by key
                existing: Doc | None = yield Call("find_one", ({"_id": doc["_id"]},))
                if existing is not None:
                    return Superseding(False, existing, superseded)
                continue  # removed in between
        holder: Doc | None = yield Call("find_one", (_holder_filter(name, group),))
        if holder is None:
            continue  # it finished in between: the index has room
        if holder["_id"] == doc["_id"]:
            return Superseding(False, holder, superseded)
        if policy == "drop_newer":
            return Superseding(False, holder, superseded, dropped=True)
        if policy == "cancel_queued" and holder.get("status") == TaskStatus.RUNNING.value:
            # left running; it leaves the index so that the newer queues behind it
            yield Call(
                "update_one",
                (
                    {
                        "_id": holder["_id"],
                        "status": TaskStatus.RUNNING.value,
                        FIELD: {"$type": "string"},
                    },
                    {"$unset": {FIELD: ""}},
                ),
            )
            continue
        allowed = [TaskStatus.PENDING.value] if policy == "cancel_queued" else list(OPEN)
        ended = yield Call(
            "update_one",
            (
                {
                    "_id": holder["_id"],
                    "status": {"$in": allowed},
                    FIELD: {"$type": "string"},
                    **WELL_FORMED,
                },
                [{"$set": {BY: doc["_id"]}}, *cancel_pipeline(now)],
            ),
        )
        if ended.matched_count:
            superseded.append(holder["_id"])
    raise StorageError(f"supersede: no place for {doc['_id']!r} after {MAX_ROUNDS} rounds")
