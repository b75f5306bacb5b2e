"""The change stream of finding work: what it asks the server for (``stream_pipeline``), how
an ``Inbox`` follows it (``follow``, on the one reopen loop of ``mtask.follow.events``), the claim
a change led to sent before the stream's next read (``ClaimsFirst``), and ``OwnStream``, a
worker's own stream (``--stream own``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pymongo.errors import PyMongoError

from mtask import store
from mtask.errors import StorageError
from mtask.follow import events
from mtask.limits.rules import LIMIT_FIELDS
from mtask.limits.slots import TAKEN_AT
from mtask.worker.finding.protocols import ClaimsBack, Inbox, NoClaims

log = logging.getLogger(__name__)

STREAM_BATCH = 1000
"""Events per getMore at most: a worker that falls behind a busy stream decodes at most this
many at once, not a 16 MB batch."""
OTHER_COLLECTIONS = ("controls", "limits", "schedules")
CLAIM_WAIT = 0.005
"""The longest a stream's next read waits for the claim its worker is making (a claim takes
1-2 ms here): what a change arriving meanwhile may wait at most for it (``ClaimsFirst``)."""


def stream_pipeline(tasks: str, excluded: str | Sequence[str]) -> list[dict[str, Any]]:
    """The change stream of a worker (``excluded``: its id) or of the relay (its own worker's
    id while that is alone, else none): task inserts, deletes and changes of ``next_claim_at``
    (with the ``last_write`` tag that says whose claim or success it is), except the claims
    and successes of the ``excluded`` workers (they know what they wrote), and the controls,
    limits and schedules."""
    changed: dict[str, Any] = {
        "operationType": "update",
        "$or": [
            {"updateDescription.updatedFields.next_claim_at": {"$exists": True}},
            # a claim or success that leaves next_claim_at as it was (a task of concurrency
            # > 1 with a slot left): the relay still hears whose it was
            {f"updateDescription.updatedFields.{store.LAST_WRITE}": {"$exists": True}},
        ],
    }
    ids = [excluded] if isinstance(excluded, str) else list(excluded)
    if ids:
        # The server applies this to the oplog entries, before it builds an event.
        changed[f"updateDescription.updatedFields.{store.LAST_WRITE}"] = {
            "$nin": [tag for worker_id in ids for tag in own_tags(worker_id)]
        }
    task_events = {
        "ns.coll": tasks,
        "$or": [{"operationType": {"$in": ["insert", "replace", "delete"]}}, changed],
    }
    projection: dict[str, Any] = {
        "operationType": 1,
        "documentKey": 1,
        "ns": 1,
        "updateDescription.updatedFields.next_claim_at": 1,
        "updateDescription.updatedFields.available_at": 1,  # a retry's new place in line
        f"updateDescription.updatedFields.{store.LAST_WRITE}": 1,  # whose claim or success
        # a change of a name's limit (a task has no such field: no byte more in its events)
        **{f"updateDescription.updatedFields.{f}": 1 for f in LIMIT_FIELDS},
        **{f"fullDocument.{f}": 1 for f in ("_id", *store.PLACEMENT_FIELDS)},
    }
    others = {
        "ns.coll": {"$in": list(OTHER_COLLECTIONS)},
        # a limit slot taken frees none: whoever waits for a slot does not need to hear of it
        # (nor of a group's document made by its first take)
        "$nor": [
            {f"updateDescription.updatedFields.{TAKEN_AT}": {"$exists": True}},
            {"operationType": "insert", f"fullDocument.{TAKEN_AT}": {"$exists": True}},
        ],
    }
    return [{"$match": {"$or": [task_events, others]}}, {"$project": projection}]


def own_tags(worker_id: str) -> list[str]:
    return [store.claim_tag(worker_id), store.success_tag(worker_id)]


async def follow(
    database: Any,
    pipeline: Callable[[], list[dict[str, Any]]],
    inbox: Inbox,
    at: events.Position | None = None,
) -> None:
    """Feed ``inbox`` from a change stream on ``database`` until cancelled: ``opened`` after
    each (re)open (but one asked for by ``at.switch()``), ``on_change`` for each event,
    ``settle`` after each event or quiet wait. A failure of the inbox's own reads (MongoDB
    away) reopens the stream where it was, as a failed stream does."""
    at = at or events.Position(fresh_when_lost=True)
    backoff = 0.05
    while True:
        waits = events.follow_waits(
            database, pipeline, at, batch_size=STREAM_BATCH, on_open=inbox.opened
        )
        restarts = at.restarts
        try:
            async with contextlib.aclosing(waits):
                async for change in waits:
                    if at.restarts != restarts:
                        restarts = at.restarts
                        inbox.restarted()
                    if change is not None:
                        inbox.on_change(change)
                        # let a woken claimer send its claim before this task
                        # spends its turn sending the next getMore (W2 latency)
                        await asyncio.sleep(0)
                    await inbox.settle()
                    backoff = 0.05
        except (StorageError, PyMongoError) as exc:
            log.warning("following the change stream: %s; reopening", exc)
            inbox.restarted()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 2.0)


class ClaimsFirst:
    """The claims a stream's changes led to are sent before the stream is read again.

    The stream's reader and the worker share one event loop, and PyMongo's async client takes
    about nine turns of it for one command: a ``getMore`` sent first runs its client work
    before the claim's, and between its turns (about 0.25 ms of W2's latency,
    ``docs/journal/2026-11.md``). So the reader notes ``handed`` when it passes a change on, and
    before its next read awaits ``settled``: two turns (the change placed, the claimer woken;
    the claim on its way), then the claims begun since the first change handed are back, or
    ``CLAIM_WAIT`` has passed. Its reader calls ``settled`` only once it has passed on the
    changes its stream had read together (``events.Position.buffered``): those are claimed
    together. Claims begun before (a batch of limited names beside the main loop) are not
    waited for."""

    def __init__(self, claims: ClaimsBack) -> None:
        self.claims = claims
        self.mark: int | None = None
        """``claims.claims_mark()`` when the first change since the last ``settled`` was
        handed; ``None``: none was."""

    def handed(self) -> None:
        if self.mark is None:
            self.mark = self.claims.claims_mark()

    def forget(self) -> None:
        """What was handed is no longer waited for."""
        self.mark = None

    async def settled(self) -> None:
        mark, self.mark = self.mark, None
        if mark is None:
            return
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        await self.claims.claims_back(mark, CLAIM_WAIT)


class ClaimsFirstInbox:
    """An ``Inbox`` whose stream reads on once the claims its changes led to are back."""

    def __init__(self, inbox: Inbox, first: ClaimsFirst, at: events.Position) -> None:
        self.inbox = inbox
        self.first = first
        self.at = at

    async def opened(self) -> None:
        await self.inbox.opened()

    def on_change(self, change: Mapping[str, Any]) -> None:
        self.first.handed()
        self.inbox.on_change(change)

    async def settle(self) -> None:
        await self.inbox.settle()
        if not self.at.buffered:
            await self.first.settled()

    def restarted(self) -> None:
        self.first.forget()
        self.inbox.restarted()


class OwnStream:
    """A worker's own change stream (``--stream own``, or while it finds its own work);
    ``claims``: the worker's, sent before the stream's next read (``ClaimsFirst``)."""

    name = "stream"

    def __init__(
        self,
        database: Any,
        tasks: str,
        worker_id: str,
        inbox: Inbox,
        claims: ClaimsBack | None = None,
    ) -> None:
        self.database = database
        self.tasks = tasks
        self.worker_id = worker_id
        self.inbox = inbox
        self.claims: ClaimsBack = NoClaims() if claims is None else claims

    async def run(self) -> None:
        # One stream on the database: the tasks collection and the controls, limits, schedules.
        at = events.Position(fresh_when_lost=True)
        inbox = ClaimsFirstInbox(self.inbox, ClaimsFirst(self.claims), at)
        await follow(self.database, lambda: stream_pipeline(self.tasks, self.worker_id), inbox, at)
