"""The worker's side of the cluster-wide limits (``mtask.limits``).

The gate knows which names are limited (read again at once when a limit document of a name it
does not know as limited changes — a new limit applies as soon as its event comes — and every
``REFRESH_SECONDS`` whatever happens, which bounds a lost event and a removed limit), takes a
slot and token before each claim of such a name, remembers the keys a limit held back and puts
them back in the claim queue when a slot may have freed (a change event on the name's limit
document) or when the next token is due, and gives slots back in batches after the runs end.
It never decides a limit itself: ``limits.acquire`` does, on the server.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from collections.abc import Iterable
from typing import Any, ClassVar

from mtask import limits
from mtask.clock import Clock
from mtask.driver import AsyncDriver
from mtask.errors import StorageError
from mtask.worker.finding.protocols import QueueSink
from mtask.worker.service import PeriodicService, event_or_timeout
from mtask.worker.wiring import Signal

log = logging.getLogger(__name__)

REFRESH_SECONDS = 5.0
DEFAULT_SLOT_LEASE_MS = 30_000


class LimitGate(PeriodicService):
    """Also the side service that re-reads the limits (every ``REFRESH_SECONDS``, and on an
    event for a name not known as limited)."""

    name: ClassVar[str] = "limits"
    failure: ClassVar[str] = "cannot read the limits, retrying"
    run_first: ClassVar[bool] = True
    interval = REFRESH_SECONDS

    def __init__(
        self,
        driver: AsyncDriver,
        worker_id: str,
        clock: Clock,
        sink: QueueSink,
        interval: float = REFRESH_SECONDS,
        changes: Signal[[str]] | None = None,
    ) -> None:
        self.interval = interval
        """Seconds between two reads of the limits whatever happens (their change events come
        at once; this bounds a lost one and a removed limit)."""
        self.driver = driver
        self.worker_id = worker_id
        self.clock = clock
        self.sink = sink
        if changes is not None:
            changes.connect(self.on_change)  # a limit's change event, from the finding parts
        self.limited: dict[str, dict[str, Any]] = {}
        self.blocked: dict[str, set[str]] = {}
        self.releases: dict[str, list[str]] = {}
        self.refreshed = asyncio.Event()
        self.unknown_changed = asyncio.Event()
        """A limit document of a name not known as limited changed: read the limits now."""

    def is_limited(self, name: str | None) -> bool:
        return name in self.limited

    async def refresh(self) -> None:
        docs = await self.driver.run(limits.all_limits())
        limited = {str(d["_id"]): d for d in docs}
        for name in set(self.blocked) - set(limited):  # a limit was removed: free its keys
            self.on_change(name)
        self.limited = limited
        self.refreshed.set()

    async def wait(self) -> None:
        await event_or_timeout(self.unknown_changed, self.interval)
        self.unknown_changed.clear()

    async def run_once(self) -> None:
        await self.refresh()

    async def take(
        self, name: str, run_id: str, key: str, now: dt.datetime, lease_ms: int | None
    ) -> limits.Acquired | None:
        """A slot and token for this run, or why not; ``None`` if MongoDB could not say."""
        try:
            return await self.driver.run(
                limits.acquire(
                    name, run_id, key, self.worker_id, now, lease_ms or DEFAULT_SLOT_LEASE_MS
                )
            )
        except StorageError as exc:
            log.warning(
                "cannot take a slot of %r's limit, retrying shortly: %s",
                name,
                exc,
                extra={"limit": name, "key": key},
            )
            return None

    def block(self, name: str, key: str, until: dt.datetime) -> None:
        """``key`` waits for ``name``'s limit: back in the queue at ``until`` (the next token,
        or the earliest slot lease end) or at once when the limit document changes."""
        self.blocked.setdefault(name, set()).add(key)
        self.sink.requeue_at(key, until)

    def on_change(self, name: str) -> None:
        """The limit document of ``name`` changed (a slot freed, the limit was edited, or a
        new limit was set)."""
        if name not in self.limited:
            self.unknown_changed.set()
        keys = self.blocked.pop(name, ())
        if keys:
            now = self.clock.now()
            for key in keys:
                self.sink.requeue_at(key, now)

    def release_later(self, name: str, run_ids: Iterable[str]) -> None:
        self.releases.setdefault(name, []).extend(run_ids)

    async def flush(self) -> None:
        """Give back the slots of runs that ended. A release that fails is not retried: the
        slot runs out with its lease, as if the worker had died."""
        releases, self.releases = self.releases, {}
        for name, run_ids in releases.items():
            try:
                await self.driver.run(limits.release(name, run_ids))
            except StorageError as exc:
                log.warning(
                    "cannot give back %d slot(s) of %r (they run out): %s", len(run_ids), name, exc
                )
