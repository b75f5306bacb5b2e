"""The limit slots of ended runs given back (``SlotReleases``, the recorder's ``SlotReturns``).

A run's end gives its slots back once its outcome is written, in one write per batch of
outcomes (``flush``). A lock's slot a key of this worker waits for is kept for that key instead
(``handover.Handovers``): the key goes back in the claim queue, and its take replaces the ended
run (``hand_over``); a place the claimer did not use in its next pass is given back
(``unused``). A sequence's lock is its task's: given up by the outcome itself, its waiting keys
are tried again. The keys that wait for a slot are the gate's (``LockWaits``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable
from typing import Protocol

from mtask.clock import Clock
from mtask.driver import AsyncDriver
from mtask.errors import StorageError
from mtask.limits import rules as limits
from mtask.limits import slots
from mtask.store import slots as store_slots
from mtask.worker.claiming.handover import Handovers

log = logging.getLogger(__name__)


class LockWaits(Protocol):
    """The keys that wait for a slot, as the releases see them (the ``LimitGate``)."""

    def waiting_for_lock(self, slot: str, most: int) -> list[str]: ...

    def retry_now(self, keys: list[str]) -> None: ...

    def on_change(self, slot: str) -> None: ...


class SlotReleases:
    """The slots of this worker's ended runs, given back in batches or kept for a handover."""

    def __init__(self, driver: AsyncDriver, clock: Clock, waits: LockWaits) -> None:
        self.driver = driver
        self.clock = clock
        self.waits = waits
        """The keys of this worker that wait for a slot (a kept lock's go back in the queue)."""
        self.releases: dict[str, list[str]] = {}
        """Per slot, the run ids whose slots are given back with the outcomes now pending."""
        self.handovers = Handovers()
        """Lock slots of ended runs kept for a key of this worker that waits for them."""

    def release_later(self, slot: str, run_ids: Iterable[str]) -> None:
        self.releases.setdefault(slot, []).extend(run_ids)

    def take_releases(self) -> dict[str, list[str]]:
        """The slots given back so far (by runs whose outcomes are pending now): the recorder
        flushes them once those outcomes are written."""
        releases, self.releases = self.releases, {}
        return releases

    def keep_for_handover(self, releases: dict[str, list[str]]) -> dict[str, list[str]]:
        """Of the ended runs' slots to give back, keep a lock's for the keys of this worker
        that wait for it (as many as there are such keys, which go back in the queue now);
        returns the rest, to give back."""
        kept_at = time.monotonic()
        rest: dict[str, list[str]] = {}
        for slot, ids in releases.items():
            fresh = [r for r in ids if r not in self.handovers.offered]
            waiting = self.waits.waiting_for_lock(slot, len(fresh))
            if given := self.handovers.keep(slot, ids, len(waiting), kept_at):
                rest[slot] = given
            self.waits.retry_now(waiting)
        return rest

    def hand_over(self, request: slots.Request) -> slots.Request:
        """``request`` taking the place of an ended run of this worker, if one holds its slot."""
        if request.replaces is not None or not slots.is_lock(request):
            return request
        run_id = self.handovers.take(request.slot)
        return request if run_id is None else dataclasses.replace(request, replaces=run_id)

    def refused(self, run_id: str) -> None:
        """A take that replaced ``run_id`` was refused, or MongoDB could not say: its place goes
        back with the next flush (``Handovers.refused``)."""
        self.handovers.refused(run_id)

    def unused(self, before: float) -> dict[str, list[str]]:
        """Remove and return the kept slots kept before ``before`` (monotonic)."""
        return self.handovers.unused(before)

    async def flush(self, releases: dict[str, list[str]] | None = None, keep: bool = True) -> None:
        """Give back the slots of runs that ended (``releases``, or all given back so far), in
        one write (but those kept for a handover, if ``keep``). A release that fails is not
        retried: the slots run out with their leases, as if the worker had died."""
        releases = self.take_releases() if releases is None else dict(releases)
        for slot in [s for s in releases if limits.is_claim_lock(s)]:
            # a sequence's lock is its task's: given up by the outcome just written, with no
            # write of its own; the keys of this worker that wait for it are tried again
            del releases[slot]
            self.waits.on_change(slot)
        if keep:
            releases = self.keep_for_handover(releases)
        else:
            for slot, run_ids in self.handovers.forget().items():
                releases.setdefault(slot, []).extend(run_ids)
        if not releases:
            return
        try:
            await self.driver.run(store_slots.release(releases))
        except StorageError as exc:
            log.warning(
                "cannot give back %d slot(s) (they run out): %s",
                sum(len(r) for r in releases.values()),
                exc,
            )
