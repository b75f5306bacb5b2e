"""One follower: a collection's change stream, followed for the whole cluster by the process that
holds its lease (``holdings.Holdings``), its changes handed to its ``Reaction`` in batches.

Its position moves past a change only once the reaction is done with it (the tasks published,
or woken), and is written to MongoDB with the lease's next renewal (``store.followers``): a
holder killed at any moment leaves a position at or before the first change whose effect may be
missing, and the next holder hands those changes out again, to idempotent reactions. A new
follower (or one reset) opens its stream at now and writes that position before anything else;
a scan that is due runs before the stream is followed, with its progress written as it goes.
When the stream's history after the position is lost (``events.HISTORY_LOST``, a dropped or
renamed collection), the follower says so (a warning, ``mtask_follower_history_lost_total``,
``lost`` in its document) and scans from now, never losing a document's current state silently.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from pymongo.errors import PyMongoError

from mtask import metrics
from mtask.clock import Clock
from mtask.driver import AsyncDriver, Doc, storage_error
from mtask.errors import EventsLost, LeaseLost, StorageError
from mtask.follow.events import HISTORY_LOST, Position, follow_waits
from mtask.store import followers
from mtask.triggers import cluster_time
from mtask.worker.reacting.protocols import Reaction
from mtask.worker.worker_events import Emitter, Event

log = logging.getLogger(__name__)
T = TypeVar("T")

BATCH = 500
"""Changes handed to the reaction at once, at most (fewer when the stream holds no more)."""
AWAIT_MS = 2000
"""How long an idle follower's ``getMore`` waits for a change (the worker's own waits 500 ms):
an idle trigger costs the server one ``getMore`` every two seconds."""
RETRY_MAX_S = 5.0
LOST_CODES = {**HISTORY_LOST, 47: "NoMatchingDocument"}
"""After these the stream cannot go on after its position: the history is gone, or (a trigger
with ``images=True``) a change's post-image is (images enabled after it, or expired)."""


class Follower:
    """Runs while this process holds the follower's lease; cancelled when it is lost."""

    def __init__(
        self,
        driver: AsyncDriver,
        clock: Clock,
        *,
        id: str,
        holder: str,
        reaction: Reaction,
        state: followers.State,
        emit: Emitter,
    ) -> None:
        self.driver = driver
        self.clock = clock
        self.id = id
        self.holder = holder
        self.reaction = reaction
        self.state = state
        self.emit = emit
        self._progress = followers.Progress(id)
        """What the next renewal writes: the position and the counts since the last one."""

    # -- what the holder writes with its renewal ----------------------------------------------

    def take(self) -> followers.Progress:
        """The progress to write now; later progress starts afresh."""
        taken, self._progress = self._progress, followers.Progress(self.id)
        return taken

    def give_back(self, taken: followers.Progress) -> None:
        """A renewal that failed: what it carried is written with the next one, unless newer."""
        now = self._progress
        now.token = now.token if now.token is not None else taken.token
        now.at = now.at or taken.at
        now.through = now.through or taken.through
        now.changes += taken.changes
        now.published += taken.published

    # -- the follower's life --------------------------------------------------------------------

    async def run(self) -> None:
        state = self.state
        told = False
        while True:
            token = state.token if state.token is not None else await self._retrying(self._fresh)
            if not told:  # from here on, every change is handed out
                self.emit(Event.FOLLOWING, follower=self.reaction.label)
                told = True
            if state.scan is not None:
                await self._scan(state.scan)
            try:
                await self._follow(token)
            except EventsLost as exc:
                state = await self._lost(exc)

    def _collection(self) -> Any:
        return self.driver.collections["tasks"].database[self.reaction.collection]

    async def _fresh(self) -> Doc:
        """The stream opened at now: its position, written (under the lease) before anything
        is handled from it."""
        collection = self._collection()
        try:
            async with await collection.watch(
                self.reaction.pipeline(), full_document=self.reaction.full_document
            ) as stream:
                token: Doc = dict(stream.resume_token or {})
        except PyMongoError as exc:
            raise storage_error(exc) from exc
        fresh = followers.Progress(self.id, token=token, through=self.clock.now())
        if not await self.driver.run(followers.save(self.holder, fresh)):
            raise LeaseLost(f"{self.reaction.label}: the lease is gone")
        return token

    async def _scan(self, scan: Doc) -> None:
        async def save(after: Any, published: int) -> None:
            extra = {"scan.after": {"$literal": after}, "scan.published": published}
            saved = followers.Progress(self.id, extra=extra)
            if not await self.driver.run(followers.save(self.holder, saved)):
                raise LeaseLost(f"{self.reaction.label}: the lease is gone")

        log.info("%s: scanning the matching documents (epoch %s)", self.reaction.label, scan)
        published = await self._retrying(lambda: self.reaction.catch_up(scan, save))
        done = followers.Progress(
            self.id, published=published, extra={"scan.done": True, "scan.done_at": "$$NOW"}
        )
        if not await self.driver.run(followers.save(self.holder, done)):
            raise LeaseLost(f"{self.reaction.label}: the lease is gone")
        self.emit(Event.SCANNED, follower=self.reaction.label, published=published)

    async def _follow(self, token: Doc) -> None:
        at = Position(token, lost_codes=LOST_CODES)
        sweeper = None
        if self.reaction.sweep_every is not None:
            sweeper = asyncio.create_task(self._sweeps(self.reaction.sweep_every))
        changes = follow_waits(
            self._collection(),
            self.reaction.pipeline,
            at,
            full_document=self.reaction.full_document,
            await_ms=AWAIT_MS,
        )
        batch: list[Doc] = []
        try:
            async with contextlib.aclosing(changes):
                async for change in changes:
                    if change is not None:
                        batch.append(change)
                        if at.buffered and len(batch) < BATCH:
                            continue
                    if batch:
                        await self._handle(batch)
                        batch = []
                    if change is None and at.token is not None:  # caught up: nothing is owed
                        self._progress.token = dict(at.token)
                        self._progress.through = self.clock.now()
        finally:
            if sweeper is not None:
                sweeper.cancel()

    async def _handle(self, batch: list[Doc]) -> None:
        published = await self._retrying(lambda: self.reaction.changes(batch))
        last = batch[-1]
        when = cluster_time(last)
        progress = self._progress
        progress.token = dict(last["_id"])
        progress.at = when or progress.at
        progress.through = when or progress.through
        progress.changes += len(batch)
        progress.published += published
        metrics.by_name(metrics.FOLLOWER_CHANGES, self.reaction.label).inc(len(batch))
        self.emit(
            Event.REACTED, follower=self.reaction.label, changes=len(batch), published=published
        )

    async def _retrying(self, act: Callable[[], Awaitable[T]]) -> T:
        """``act()`` until MongoDB answers it (its effects are idempotent)."""
        delay = 0.1
        while True:
            try:
                return await act()
            except StorageError as exc:
                log.warning("%s: %s; trying again", self.reaction.label, exc)
            await asyncio.sleep(delay)
            delay = min(delay * 2, RETRY_MAX_S)

    async def _sweeps(self, every: float) -> None:
        scan: Doc = {"epoch": 0, "after": None}

        async def nothing(after: Any, published: int) -> None:
            return None

        while True:
            await asyncio.sleep(every)
            with contextlib.suppress(StorageError):
                await self.reaction.catch_up(scan, nothing)

    async def _lost(self, exc: EventsLost) -> followers.State:
        log.warning(
            "%s: the change stream's history after its position is lost (%s): scanning the "
            "documents as they are now; changes made in between are seen only through them",
            self.reaction.label,
            exc,
        )
        metrics.by_name(metrics.FOLLOWER_HISTORY_LOST, self.reaction.label).inc()
        self.emit(Event.HISTORY_LOST, follower=self.reaction.label, reason=str(exc))
        self._progress = followers.Progress(self.id)  # the old position must not be written
        doc = await self.driver.run(followers.lost(self.holder, self.id))
        if doc is None:
            raise LeaseLost(f"{self.reaction.label}: the lease is gone")
        return followers.State.of(doc)
