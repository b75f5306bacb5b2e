"""The relay's claim queue, for every subscribed worker on any host.

A ``Placement`` in ``HostScope`` (every subscriber's names and ids, no stagger), its
``Scanner`` and ``Sweep``, fed by the relay's one change stream (it is the relay stream's
``Inbox`` while the relay hands out). It exposes what the ``Dispatcher`` needs; the
dispatcher's keys on their way to a subscriber count as in flight (``busy``), so an event does
not queue them again. While the relay's own worker is its only subscriber, the relay idles it
(``idle``: it holds nothing and scans nothing) and activates it again when it hands out
(``activate``: a scan at once).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from collections.abc import Callable, Mapping
from typing import Any

from mtask import driver
from mtask.clock import Clock
from mtask.errors import StorageError
from mtask.worker.claim_queue import ClaimQueue
from mtask.worker.finding.changes import apply_task_change
from mtask.worker.finding.placement import HostScope, Placement, TaskMeta
from mtask.worker.finding.scan import Scanner, Sweep

log = logging.getLogger(__name__)


class HostQueue:
    def __init__(
        self,
        driver: driver.AsyncDriver,
        clock: Clock,
        *,
        busy: Callable[[str], bool],
        wake: Callable[[], None],
        queue: ClaimQueue,
        sweep_interval: float = 30.0,
    ) -> None:
        self.scope = HostScope()
        self.queue = queue
        self.placement = Placement(self.queue, self.scope, in_flight=busy, wake=wake)
        self.scanner = Scanner(driver, self.placement, clock, sweep_interval=sweep_interval)
        self.sweep = Sweep(self.rescan, self.scanner.rescan_requested, sweep_interval)
        self._active = True
        """False while idle (``idle``, until ``activate`` or ``opened``)."""
        self._scanned: frozenset[str] = frozenset()
        """The names the last scan began with."""
        self._scan: asyncio.Task[None] | None = None

    # -- as the dispatcher sees it ---------------------------------------------------------

    def serve(self, names: list[str], ids: tuple[str, ...]) -> bool:
        """Queue the tasks of ``names`` for the workers ``ids``; True if either grew (their
        tasks may be open already: a rescan is asked for)."""
        grew = not set(names) <= set(self.scope.names) or not set(ids) <= set(self.scope.ids)
        self.scope.names, self.scope.ids = names, ids
        if grew:
            self.scanner.request_rescan()
        return grew

    def known(self, key: str) -> TaskMeta | None:
        return self.placement.known(key)

    def place(self, doc: Mapping[str, Any]) -> None:
        self.scanner.place_safely(doc)

    def requeue_at(self, key: str, when: dt.datetime) -> None:
        self.placement.move_known(key, when)

    def read_again(self, key: str) -> None:
        """Read ``key``'s document again (``settle``): its event did not say where it goes."""
        self.scanner.unknown.add(key)
        self.queue.discard(key)

    def forget(self, key: str) -> None:
        self.placement.forget(key)

    def request_rescan(self) -> None:
        self.scanner.request_rescan()

    # -- as the relay sees it ----------------------------------------------------------------

    def idle(self) -> None:
        """Hold nothing and scan nothing (the relay's own worker finds its own work)."""
        self._active = False
        self.placement.clear()

    def activate(self) -> None:
        """Queue every subscriber's tasks again (the relay hands out): a scan at once, not
        after the sweep's gap (a relay that took over hands out within a second)."""
        if not self._active:
            self._active = True
            self._scan_soon()

    def catch_up(self) -> None:
        """Scan at once if it serves names the last scan did not read (a subscriber of new
        names, the first ones of a relay that took over), not after the sweep's gap."""
        if self._active and not set(self.scope.names) <= self._scanned:
            self._scan_soon()

    def stop(self) -> None:
        """Cancel a scan on its way (the relay stops: its client may close under it)."""
        if self._scan is not None:
            self._scan.cancel()
        self._active = False

    def _scan_soon(self) -> None:
        self._scanned = frozenset(self.scope.names)  # (many hellos at once: one scan)
        self._scan = asyncio.get_running_loop().create_task(self._scan_now())

    async def _scan_now(self) -> None:
        try:
            await self.rescan(requested=True)  # (not a search for stranded documents)
        except StorageError as exc:
            log.warning("the relay's queue could not scan (%s): its sweep tries again", exc)
            self.scanner.request_rescan()

    # -- the relay stream's Inbox ----------------------------------------------------------

    async def opened(self) -> None:
        self._active = True
        await self.rescan()

    def on_change(self, change: Mapping[str, Any]) -> None:
        apply_task_change(self.scanner, change)

    async def settle(self) -> None:
        await self.scanner.settle()

    async def rescan(self, requested: bool = False) -> int:
        """Scan, while the queue is active."""
        if not self._active:
            return 0
        self._scanned = frozenset(self.scope.names)
        return await self.scanner.rescan(requested)
