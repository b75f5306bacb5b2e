"""One claim call, and what a failed one leaves to do (``ClaimCalls``).

A claim call that fails is followed by a read of what it may have taken anyway (``adopt``: a
multi-document write is not retried by the driver, and its reply may be lost after it was
applied); one that ran out of time may have waited for the open transaction of a run whose lease
has ended, which is killed (``kill_stale_transactions``); a batch refused because of one
document's write error is claimed again one key at a time (``isolate``) and the bad document
marked invalid (``mark_invalid``), or ignored from then on if even that cannot be written.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import uuid
from collections.abc import Callable
from typing import Any

from mtask import store
from mtask.clock import Clock
from mtask.driver import AsyncDriver
from mtask.errors import StorageError
from mtask.store.transactional import expired_transactions, kill_sessions

log = logging.getLogger("mtask.worker.claiming.claimer")  # the name operators filter on, kept

RETRY_SOON = dt.timedelta(seconds=1)
"""How long a key waits after a claim or a slot could not be had because of MongoDB."""
ADOPT_ATTEMPTS = 5


class ClaimCalls:
    """The claim calls of one worker, each with its recovery."""

    def __init__(
        self, driver: AsyncDriver, clock: Clock, *, worker_id: str, ignore: Callable[[Any], None]
    ) -> None:
        self.driver = driver
        self.clock = clock
        self.worker_id = worker_id
        self.ignore = ignore
        """Ignore a key from now on (``QueueSink.ignore``): its document can be neither claimed
        nor marked invalid."""
        self.skip_unopened = False
        """This worker met an encrypted task it cannot decrypt (``met_unopened``): its claims
        leave the encrypted tasks it gave back undecrypted to the workers that hold the key
        (``store.unopened_by``). A worker that never met one adds nothing to its claims."""

    def met_unopened(self) -> None:
        self.skip_unopened = True

    async def send(
        self,
        keys: list[str],
        names: list[str],
        now: dt.datetime,
        hints: dict[str, int] | None,
        *,
        isolate_on_error: bool,
        batch: str | None = None,
    ) -> list[dict[str, Any]] | None:
        """One claim call, and on a storage error what it took anyway (``adopt``), plus, for
        one document's write error, the rest claimed one by one (``isolate``). ``None``: the
        call failed and nothing was taken."""
        batch = batch or uuid.uuid4().hex
        try:
            return await self.driver.run(
                store.claim(
                    keys,
                    names,
                    self.worker_id,
                    now,
                    hints,
                    store.CLAIMED_FIELDS,
                    batch,
                    skip_unopened=self.skip_unopened,
                )
            )
        except StorageError as exc:
            log.warning(
                "claim failed, retrying shortly: %s", exc, extra={"keys": len(keys), "batch": batch}
            )
            docs = await self.adopt(keys, batch)
            if exc.timed_out:
                await self.kill_stale_transactions(keys)
            if exc.document and isolate_on_error:
                adopted = {d["_id"] for d in docs}
                return docs + await self.isolate([k for k in keys if k not in adopted], names, now)
            return docs or None

    async def send_locked(
        self, groups: dict[str, tuple[str, str]], names: list[str], now: dt.datetime, batch: str
    ) -> tuple[list[dict[str, Any]], set[str]] | None:
        """Claim sequences' heads with their groups' locks (``store.claim_locked``): the
        documents claimed and the keys whose group is busy; ``None`` if MongoDB failed (what
        the call took anyway is adopted). A document the server cannot update is marked
        invalid."""
        try:
            docs, busy, broken = await self.driver.run(
                store.claim_locked(
                    groups,
                    names,
                    self.worker_id,
                    now,
                    store.CLAIMED_FIELDS,
                    batch,
                    skip_unopened=self.skip_unopened,
                )
            )
        except StorageError as exc:
            log.warning(
                "claim failed, retrying shortly: %s",
                exc,
                extra={"keys": len(groups), "batch": batch},
            )
            adopted = await self.adopt(list(groups), batch)
            if exc.timed_out:  # as ``send``'s: a sequence's task may be held the same way
                await self.kill_stale_transactions(list(groups))
            return (adopted, set()) if adopted else None
        for key, reason in broken.items():
            await self.mark_invalid(key, f"a claim cannot update the document: {reason}")
        return docs, busy

    async def isolate(
        self, keys: list[str], names: list[str], now: dt.datetime
    ) -> list[dict[str, Any]]:
        """Claim ``keys`` one at a time after a batch claim failed on one document's write
        error; mark the documents whose own claim fails so ``invalid`` with the error (or,
        when even that cannot be written, ignore them from now on, logged once)."""
        claimed: list[dict[str, Any]] = []
        for key in keys:
            try:
                claimed += await self.driver.run(
                    store.claim(
                        [key],
                        names,
                        self.worker_id,
                        now,
                        None,
                        store.CLAIMED_FIELDS,
                        uuid.uuid4().hex,
                        isolate=True,
                        skip_unopened=self.skip_unopened,
                    )
                )
            except StorageError as exc:
                if not exc.document:
                    break  # not this document's fault: the sweep brings the rest back
                await self.mark_invalid(key, f"a claim cannot update the document: {exc}")
        return claimed

    async def mark_invalid(self, key: str, reason: str) -> None:
        try:
            await self.driver.run(store.quarantine([key], self.clock.now(), reason))
            log.warning("marked task %r invalid: %s", key, reason, extra={"key": key})
        except StorageError as exc:
            if not exc.document:  # MongoDB in trouble: a later claim tries again
                log.warning(
                    "cannot mark task %r invalid now (%s): %s", key, reason, exc, extra={"key": key}
                )
                return
            log.warning(
                "ignoring task %r from now on: %s (cannot mark it invalid: %s)",
                key,
                reason,
                exc,
                extra={"key": key},
            )
            self.ignore(key)

    async def kill_stale_transactions(self, keys: list[str]) -> None:
        """After a claim ran out of time: it may have waited for the open transaction of a run
        whose lease has ended (frozen or killed between its fenced SUCCESS and its commit),
        which the server would keep for a minute or more. Kill those transactions: the retried
        claim goes through (docs/transactions.md, "Under faults")."""
        try:
            stale = await self.driver.run(expired_transactions(keys, self.clock.now()))
            if stale:
                await self.driver.run(kill_sessions(stale))
                log.warning(
                    "killed %d open transaction(s) of runs whose lease ended, in the way of a "
                    "claim",
                    len(stale),
                    extra={"keys": len(keys)},
                )
        except StorageError as exc:
            log.warning("cannot check for stale transactions: %s", exc)

    async def adopt(self, keys: list[str], batch: str) -> list[dict[str, Any]]:
        """After a failed claim call: the write may have been applied although its reply was
        lost (multi-document writes are not retried by the driver). Find and run what this
        batch claimed, rather than leave it to time out."""
        for attempt in range(ADOPT_ATTEMPTS):
            try:
                return await self.driver.run(store.read_claimed(keys, batch, store.CLAIMED_FIELDS))
            except StorageError:
                await asyncio.sleep(0.2 * 2**attempt)
        log.warning(
            "could not check what a failed claim took; its leases will run out",
            extra={"batch": batch},
        )
        return []
