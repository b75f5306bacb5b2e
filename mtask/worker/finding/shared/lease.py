"""The relay's lease, as the process holding it sees it: taken (``take``: it ran out; or taken
over by its standby, ``standby``), renewed, fresh or not, let go.

A lease lasts ``LEASE_TTL`` from its last renewal, by the server's clock (``store.relays``):
anyone may take one that ran out. Its standby may take it over much sooner: once it has not
been renewed for ``TAKE_OVER_AFTER``. So the relay renews it every ``RENEW_EVERY`` while nobody
could stand by (no subscriber in another process: a lone worker pays nothing for it), and every
``WATCHED_RENEW_EVERY`` once somebody could. A renewal that fails is tried again, each bounded
by ``RENEW_TIMEOUT`` (a relay cut off waits on a socket that never answers); a relay that has
not renewed for ``LEASE_TTL - RENEW_EVERY`` stops, and so does one that finds the lease
another's.

*Fresh*: whether the lease is certainly still this relay's, by this process's clock from the
moment its last renewal was sent (earlier than the server's: the server counts from when it
ran it). A relay writes into its subscribers' inboxes only while its lease is fresh
(``until_fresh``): a relay that froze or was cut off, and was taken over meanwhile, does not
write into the inboxes its successor let go of (each write would make the dropped collection
again) nor hand out what its successor hands out.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from mtask import driver
from mtask.errors import StorageError
from mtask.store import relays

LEASE_TTL = 10.0
"""Seconds a relay's lease lasts from its last renewal."""
RENEW_EVERY = 2.0
"""Seconds between two renewals while nobody could stand by."""
WATCHED_RENEW_EVERY = 0.3
"""Seconds between two renewals once a subscriber in another process could stand by (each a
write: 3.3 a second, the largest share of an idle cluster's constant cost)."""
TAKE_OVER_AFTER = 0.7
"""A lease not renewed for this long (by the server's clock) may be taken over by its standby:
two renewals missed (a relay stalled 0.4 s past a renewal due), a relay dead, frozen or cut
off."""
RENEW_TIMEOUT = 2.0
"""Seconds one renewal may take before it is given up and tried again."""


class LeaseLost(Exception):
    """The relay's lease is another's now, or could not be renewed in time."""


def new_id(owner: str) -> str:
    """A relay's id: its worker's id and a unique part (the lease names it, subscribers address
    their reports to it)."""
    return f"{owner}/{uuid.uuid4().hex[:12]}"


class RelayLease:
    """The lease of ``tasks`` held by the relay ``id`` of this process."""

    def __init__(
        self, driver: driver.AsyncDriver, tasks: str, id: str, sent: float | None = None
    ) -> None:
        self.driver = driver
        self.tasks = tasks
        self.id = id
        now = time.monotonic() if sent is None else sent
        self.renewed = now
        """When (monotonic) the last renewal that held was sent (or the take)."""
        self.watched = False
        """Whether a standby holds its post (as the last renewal found it)."""
        self.fresh_until = now + LEASE_TTL - RENEW_EVERY
        self._renewed = asyncio.Event()

    @classmethod
    async def take(cls, driver: driver.AsyncDriver, tasks: str, owner: str) -> RelayLease | None:
        """The lease of ``tasks`` for a new relay of the worker ``owner``, if it has run out."""
        await driver.run(relays.ensure(tasks))
        relay, sent = new_id(owner), time.monotonic()
        if not await driver.run(relays.acquire(tasks, relay, int(LEASE_TTL * 1000))):
            return None
        return cls(driver, tasks, relay, sent)

    def every(self, candidates: bool) -> float:
        """Seconds to the next renewal: often while somebody stands by or could
        (``candidates``: subscribers in other processes), else seldom."""
        return WATCHED_RENEW_EVERY if candidates or self.watched else RENEW_EVERY

    async def renew(self, candidates: bool) -> relays.Renewal | None:
        """Renew the lease: what the renewal found, or ``None`` if MongoDB did not answer in
        time (``LeaseLost`` once that has lasted too long, or if the lease is another's)."""
        sent = time.monotonic()
        try:
            async with asyncio.timeout(RENEW_TIMEOUT):
                renewal = await self.driver.run(
                    relays.renew(self.tasks, self.id, int(LEASE_TTL * 1000))
                )
        except (StorageError, TimeoutError) as exc:
            if time.monotonic() - self.renewed >= LEASE_TTL - RENEW_EVERY:
                raise LeaseLost(f"cannot renew the lease: {exc or 'no answer'}") from exc
            return None
        if renewal is None:
            raise LeaseLost("another relay holds the lease")
        self.renewed, self.watched = sent, renewal.watched
        watched = candidates or renewal.watched
        self.fresh_until = sent + (TAKE_OVER_AFTER if watched else LEASE_TTL - RENEW_EVERY)
        self._renewed.set()
        return renewal

    def fresh(self) -> bool:
        return time.monotonic() < self.fresh_until

    async def until_fresh(self) -> None:
        """Return once the lease is fresh (at once if it is)."""
        while not self.fresh():
            self._renewed.clear()
            await self._renewed.wait()

    async def release(self) -> None:
        """End the lease now: its standby, or anyone, may take it at once."""
        await self.driver.run(relays.release(self.tasks, self.id))

    def state(self) -> dict[str, Any]:
        return {"watched": self.watched}
