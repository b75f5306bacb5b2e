"""The relay's standby: one worker of another process that watches the relay's lease and takes
it over as soon as the relay stops renewing it (dead, frozen, cut off), long before it runs out.

The relay appoints it (``wire.STANDBY``, to one subscriber in another process) whenever nobody
holds the post; the standby holds the post while it renews it (``store.relays.stand_by``, every
``POST_RENEW``: it lapses ``POST_TTL`` after the last one, and the relay appoints another). It
reads how long ago the relay renewed the lease every ``WATCH_EVERY`` (``store.relays.renewed_ago``,
on the server's clock), and once that is ``lease.TAKE_OVER_AFTER`` or more, takes it over
(``store.relays.take_over``: an update that matches only for the standby, and only while the
lease has gone that long without a renewal, by the server's clock again). It stops watching
when its post is another's or the lease another relay's. It watches across its own
subscriptions (one that fails when MongoDB fails over ends; the standby goes on): the post is
the worker's.

What it costs the server is constant, whatever the number of workers and hosts: the relay's
renewals every ``lease.WATCHED_RENEW_EVERY``, the standby's reads every ``WATCH_EVERY`` and its
post every ``POST_RENEW`` (docs/finding-work.md has the figures).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Protocol, TypeVar

from mtask import driver
from mtask.errors import StorageError
from mtask.store import relays
from mtask.worker.finding.shared.lease import LEASE_TTL, TAKE_OVER_AFTER, RelayLease

log = logging.getLogger(__name__)

WATCH_EVERY = 0.1
"""Seconds between two tries to take the lease over."""
POST_RENEW = 1.0
"""Seconds between two renewals of the standby's post."""
POST_TTL = 3.0
"""Seconds the post lasts from its last renewal: then the relay appoints another standby."""
TRY_TIMEOUT = 1.0
"""Seconds one try may take (a standby cut off waits on a socket that never answers)."""


class Candidate(Protocol):
    """A subscriber in another process (``channels.InboxChannel``)."""

    def closing(self) -> bool: ...


C = TypeVar("C", bound=Candidate)


class Appointments:
    """The relay's side: whom to ask to stand by when nobody holds the post, the next
    subscriber in another process in turn, once the one asked last had ``POST_TTL`` seconds to
    take it."""

    def __init__(self) -> None:
        self.asked = 0
        """Subscribers asked so far."""
        self._last: float | None = None
        """When (monotonic) one was asked last, until one holds the post."""

    def ask(self, renewal: relays.Renewal, candidates: Sequence[C]) -> C | None:
        """Whom to ask now, as the relay's renewal found the post (``None``: nobody)."""
        if renewal.watched:
            self._last = None
            return None
        live = [c for c in candidates if not c.closing()]
        now = time.monotonic()
        if not live or (self._last is not None and now - self._last < POST_TTL):
            return None
        self._last = now
        self.asked += 1
        return live[(self.asked - 1) % len(live)]


class Standby:
    """The worker ``worker_id`` standing by for the relay ``relay_id`` of ``tasks``."""

    def __init__(
        self, driver: driver.AsyncDriver, tasks: str, worker_id: str, relay_id: str
    ) -> None:
        self.driver = driver
        self.tasks = tasks
        self.worker_id = worker_id
        self.relay_id = relay_id

    async def watch(self) -> RelayLease | None:
        """Hold the post and watch: the lease taken over, or ``None`` once the post or the
        lease is another's."""
        posted = float("-inf")
        while True:
            try:
                async with asyncio.timeout(TRY_TIMEOUT):
                    if time.monotonic() - posted >= POST_RENEW:
                        if not await self._post():
                            return None
                        posted = time.monotonic()
                    lease = await self._try()
            except (StorageError, TimeoutError) as exc:
                log.debug("standing by for relay %s: %s", self.relay_id, exc)
                lease = None
            if lease is not None:
                log.warning("relay %s went silent: its standby took its lease", self.relay_id)
                return lease
            await asyncio.sleep(WATCH_EVERY)

    async def _try(self) -> RelayLease | None:
        """The lease, if the relay has gone silent: a read while it renews (how long ago it
        did, by the server's clock), the takeover's update only once that is long enough (the
        update decides, on the server's clock again)."""
        ttl_ms = int(LEASE_TTL * 1000)
        ago = await self.driver.run(relays.renewed_ago(self.tasks, self.relay_id, ttl_ms))
        if ago is not None and ago < TAKE_OVER_AFTER * 1000:
            return None
        return await RelayLease.take_over(self.driver, self.tasks, self.worker_id, self.relay_id)

    async def _post(self) -> bool:
        ttl_ms = int(POST_TTL * 1000)
        taken: bool = await self.driver.run(
            relays.stand_by(self.tasks, self.relay_id, self.worker_id, ttl_ms)
        )
        return taken
