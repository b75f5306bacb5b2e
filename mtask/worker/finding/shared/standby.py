"""The relay's standby: one worker of another process that watches the relay's lease and takes
it over as soon as the relay stops renewing it (dead, frozen, cut off), long before it runs out.

The relay appoints it (``wire.STANDBY``, to one subscriber in another process) whenever nobody
holds the post; the standby takes the post (``store.relays.stand_by``), which lapses ``POST_TTL``
after it was last renewed (then the relay appoints another). From then on it does not poll: it
looks at the lease only when the relay could first be taken over, by the server's clock. Each
look is one atomic update (``store.relays.watch``) that takes the lease over if the relay has
not renewed it for ``lease.TAKE_OVER_AFTER`` (the update decides, on the server's clock), and
otherwise renews the post and says how long ago the relay renewed; the next look comes that much
less than ``TAKE_OVER_AFTER`` later. A relay that renews on time is looked at about once per
``TAKE_OVER_AFTER`` minus a renewal period; a dead one is taken over ``TAKE_OVER_AFTER`` after
its last renewal (the wait counts from the server's clock at the look, and the reply comes
later: never early). It stops watching when its post is another's or the lease another relay's.
It watches across its own subscriptions (one that fails when MongoDB fails over ends; the
standby goes on): the post is the worker's.

*Why not a change stream on the lease:* it would deliver every renewal, a ``getMore`` each (as
many commands as renewals), to learn what one look per ``TAKE_OVER_AFTER`` learns; a look
that finds the relay silent takes the lease at once, so nothing waits on an event, and nothing is
lost with one either.

What it costs the server is constant, whatever the number of workers and hosts: the relay's
renewals every ``lease.WATCHED_RENEW_EVERY`` and the standby's looks, under two a second
(docs/finding-work.md has the figures).
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
from mtask.worker.finding.shared.lease import LEASE_TTL, TAKE_OVER_AFTER, RelayLease, new_id

log = logging.getLogger(__name__)

RETRY_EVERY = 0.1
"""Seconds between two looks that failed (MongoDB away, or failing over)."""
MIN_WAIT = 0.02
"""The shortest wait between two looks (a relay that renews just then)."""
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
        posted, wait = False, 0.0
        while True:
            await asyncio.sleep(wait)
            try:
                async with asyncio.timeout(TRY_TIMEOUT):
                    if not posted and not await self._post():
                        return None
                    posted = True
                    lease, wait = await self._look()
            except (StorageError, TimeoutError) as exc:
                log.debug("standing by for relay %s: %s", self.relay_id, exc)
                lease, wait = None, RETRY_EVERY
            if lease is not None:
                log.warning("relay %s went silent: its standby took its lease", self.relay_id)
            if lease is not None or wait < 0:
                return lease

    async def _look(self) -> tuple[RelayLease | None, float]:
        """One look (``store.relays.watch``): the lease if it was taken over, else the seconds
        until the relay's lease may first be taken over, by the server's clock (``-1``: the post
        or the lease is another's)."""
        ttl_ms, stale_ms = int(LEASE_TTL * 1000), int(TAKE_OVER_AFTER * 1000)
        new, sent = new_id(self.worker_id), time.monotonic()
        seen = await self.driver.run(
            relays.watch(
                self.tasks,
                self.relay_id,
                self.worker_id,
                new,
                stale_ms,
                ttl_ms,
                int(POST_TTL * 1000),
            )
        )
        if seen is None:
            return None, -1.0
        if seen.taken:
            return RelayLease(self.driver, self.tasks, new, sent), 0.0
        # counted from the server's now at the look: the reply comes later, so the next look
        # comes no sooner than the relay could first be taken over
        return None, max(MIN_WAIT, TAKE_OVER_AFTER - seen.ago_ms / 1000)

    async def _post(self) -> bool:
        ttl_ms = int(POST_TTL * 1000)
        taken: bool = await self.driver.run(
            relays.stand_by(self.tasks, self.relay_id, self.worker_id, ttl_ms)
        )
        return taken
