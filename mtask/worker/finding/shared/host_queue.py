"""The relay's claim queue, for every subscribed worker on any host.

A ``Placement`` in ``HostScope`` (every subscriber's names and ids, no stagger), its
``Scanner`` and ``Sweep``, fed by the relay's one change stream (it is the relay stream's
``Inbox``). It exposes what the ``Dispatcher`` needs; the dispatcher's keys on their way to a
subscriber count as in flight (``busy``), so an event does not queue them again.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Mapping
from typing import Any

from mtask import driver
from mtask.clock import Clock
from mtask.worker.claiming.queue import ClaimQueue
from mtask.worker.finding.changes import apply_task_change
from mtask.worker.finding.placement import HostScope, Placement, TaskMeta
from mtask.worker.finding.scan import Scanner, Sweep


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
        self.active = True
        """False while the relay's own worker is its only subscriber and finds its own work:
        the host queue then holds nothing and scans nothing."""

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

    def clear(self) -> None:
        """Hold nothing and scan nothing (the relay's worker finds its own work)."""
        self.active = False
        self.placement.clear()

    def request_rescan(self) -> None:
        self.scanner.request_rescan()

    # -- the relay stream's Inbox ----------------------------------------------------------

    async def opened(self) -> None:
        self.active = True
        await self.scanner.rescan()

    def on_change(self, change: Mapping[str, Any]) -> None:
        apply_task_change(self.scanner, change)

    async def settle(self) -> None:
        await self.scanner.settle()

    async def rescan(self, requested: bool = False) -> int:
        """Scan, while the queue is active."""
        return await self.scanner.rescan(requested) if self.active else 0
