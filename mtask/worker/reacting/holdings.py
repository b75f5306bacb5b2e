"""The followers a worker process may hold (its registry's triggers and the collections its tasks
wait on), and the leases it holds: taken once they run out, renewed with their positions, let go
when paused, reset or taken.

One loop, every ``RENEW_EVERY`` seconds: the held leases and their positions renewed in one bulk
write; every ``LOOK_EVERY`` rounds, every follower's document read in one ``find`` and the free
ones taken (``store.followers.acquire``: one atomic update on the server's clock). So a standby
costs the server one read every 5 s for all its followers, whatever their number, and takes
over a follower whose holder died within one lease (10 s) and one look (5 s).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

from mtask import metrics
from mtask.clock import Clock
from mtask.driver import AsyncDriver, Op
from mtask.errors import LeaseLost, StorageError
from mtask.store import followers
from mtask.worker.reacting.follower import Follower
from mtask.worker.reacting.protocols import Reaction
from mtask.worker.worker_events import Emitter, Event

log = logging.getLogger(__name__)

TTL_MS = 10_000
"""A follower's lease: renewed every ``RENEW_EVERY`` seconds, taken by a standby once it ran out."""
RENEW_EVERY = 2.5
LOOK_EVERY = 2
"""A standby looks for free followers every this many rounds (5 s)."""
STOP_TIMEOUT = 5.0


@dataclass(frozen=True)
class Declaration:
    """A follower this process may hold: what its document says, and what it does."""

    declared: followers.Declared
    reaction: Reaction


class Holdings:
    """The ``followers`` side loop of a worker whose registry declares a trigger or a wait."""

    name: ClassVar[str] = "followers"

    def __init__(
        self,
        driver: AsyncDriver,
        clock: Clock,
        *,
        holder: str,
        declarations: Sequence[Declaration],
        emit: Emitter,
        setup: Callable[[], Op[None]] | None = None,
    ) -> None:
        self.driver = driver
        self.clock = clock
        self.holder = holder
        self.emit = emit
        self.setup = setup
        """What the first round makes before any follower runs (the data waits' index)."""
        tasks = driver.collections["tasks"].name
        self.tasks = tasks
        self.declarations = {
            followers.follower_id(tasks, d.declared.kind, d.declared.name): d for d in declarations
        }
        self.held: dict[str, tuple[Follower, asyncio.Task[None]]] = {}
        self.rounds = 0
        self._declared = False

    async def run(self) -> None:
        try:
            while True:
                try:
                    await self.round()
                except StorageError as exc:
                    log.warning("followers cannot reach MongoDB, retrying: %s", exc)
                await asyncio.sleep(RENEW_EVERY)
        finally:
            await self._stop_all()

    async def round(self) -> None:
        if not self._declared:
            declared = [d.declared for d in self.declarations.values()]
            await self.driver.run(followers.declare(self.tasks, declared, self.clock.now()))
            if self.setup is not None:
                await self.driver.run(self.setup())
            self._declared = True
        await self._reap()
        await self._renew()
        if self.rounds % LOOK_EVERY == 0:
            await self._take_free()
        self.rounds += 1

    def holds(self) -> list[str]:
        """The followers this process holds now (their labels)."""
        return sorted(f.reaction.label for f, _ in self.held.values())

    async def _reap(self) -> None:
        """Followers that ended on their own: a lost lease is let go; any other end is logged
        and the lease given back, so another process (or this one, later) takes it."""
        for id, (follower, task) in list(self.held.items()):
            if not task.done():
                continue
            del self.held[id]
            exc = None if task.cancelled() else task.exception()
            if exc is None or isinstance(exc, LeaseLost):
                continue
            log.error("%s stopped: %r; its lease is given back", follower.reaction.label, exc)
            with contextlib.suppress(StorageError):
                await self.driver.run(followers.release(self.holder, follower.take()))

    async def _renew(self) -> None:
        if not self.held:
            return
        taken = {id: follower.take() for id, (follower, _) in self.held.items()}
        try:
            kept = await self.driver.run(followers.renew(self.holder, list(taken.values()), TTL_MS))
        except StorageError:
            for id, progress in taken.items():
                self.held[id][0].give_back(progress)
            raise
        if kept < len(taken):
            await self._let_go()

    async def _let_go(self) -> None:
        """Stop the followers whose lease is no longer this process's (taken, reset) or that
        an operator paused (their position written first: they go on from it)."""
        docs = {d["_id"]: d for d in await self.driver.run(followers.look(list(self.held)))}
        for id in list(self.held):
            doc = docs.get(id)
            mine = doc is not None and doc.get("holder") == self.holder
            if mine and not (doc or {}).get("paused"):
                continue
            follower, task = self.held.pop(id)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            if mine:  # paused: its position written, its lease ended
                await self.driver.run(followers.release(self.holder, follower.take()))
            why = "paused" if mine else "taken or reset"
            log.info("%s: no longer followed here (%s)", follower.reaction.label, why)
            self.emit(Event.UNFOLLOWED, follower=follower.reaction.label, why=why)

    async def _take_free(self) -> None:
        docs = await self.driver.run(followers.look(list(self.declarations)))
        for doc in docs:
            id = doc["_id"]
            if id in self.held or doc.get("paused"):
                continue
            if not doc.get("free") and doc.get("holder") != self.holder:
                continue
            state = await self.driver.run(followers.acquire(id, self.holder, TTL_MS))
            if state is not None:
                self._start(id, followers.State.of(state))

    def _start(self, id: str, state: followers.State) -> None:
        reaction = self.declarations[id].reaction
        follower = Follower(
            self.driver,
            self.clock,
            id=id,
            holder=self.holder,
            reaction=reaction,
            state=state,
            emit=self.emit,
        )
        task = asyncio.create_task(follower.run(), name=f"mtask-follower-{reaction.label}")
        self.held[id] = (follower, task)
        metrics.by_name(metrics.FOLLOWERS_TAKEN, reaction.label).inc()
        log.info("this worker follows %s for the cluster", reaction.label)

    async def _stop_all(self) -> None:
        """A stopping worker: its followers ended, their positions written and their leases
        given back, so another process takes them at once."""
        held, self.held = self.held, {}
        for _, task in held.values():
            task.cancel()
        await asyncio.gather(*(task for _, task in held.values()), return_exceptions=True)
        for follower, _ in held.values():
            with contextlib.suppress(StorageError, TimeoutError):
                release = followers.release(self.holder, follower.take())
                await asyncio.wait_for(self.driver.run(release), STOP_TIMEOUT)
