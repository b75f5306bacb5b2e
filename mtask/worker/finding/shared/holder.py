"""Holding the relay: a worker process takes the relay's lease when it has run out, or takes it
over as the relay's standby (``standby``), and runs the relay (``relay.Relay``) beside its own
worker until it loses the lease or stops."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from mtask import driver
from mtask.clock import Clock
from mtask.worker.claim_queue import ClaimQueue
from mtask.worker.finding.shared.dispatch import Dispatcher
from mtask.worker.finding.shared.group_waiters import GroupWaiters
from mtask.worker.finding.shared.lease import RelayLease
from mtask.worker.finding.shared.mode import RelayMode
from mtask.worker.finding.shared.relay import Relay
from mtask.worker.finding.shared.standby import Standby

log = logging.getLogger(__name__)


class RelayHolder:
    def __init__(
        self,
        driver: driver.AsyncDriver,
        clock: Clock,
        worker_id: str,
        *,
        buffer: int,
        new_queue: Callable[[], ClaimQueue],
        sweep_interval: float,
    ) -> None:
        self.driver = driver
        self.clock = clock
        self.worker_id = worker_id
        self.buffer = buffer
        self.new_queue = new_queue
        self.sweep_interval = sweep_interval
        tasks = driver.collections["tasks"]
        self.database, self.tasks = tasks.database, tasks.name
        self.relay: Relay | None = None
        """The relay this process holds or held last."""
        self.took_over = 0
        """Relays this worker took over as their standby."""
        self.taken_over = asyncio.Event()
        """Set when this worker takes a relay over (``stand_by``)."""
        self._task: asyncio.Task[None] | None = None
        self._standby: asyncio.Task[Relay | None] | None = None

    def holds(self) -> bool:
        """Whether this process holds the relay now (not one stopping: it lost its lease)."""
        running = self._task is not None and not self._task.done()
        return running and self.relay is not None and self.relay.mode is not RelayMode.STOPPED

    async def take_if_free(self) -> Relay | None:
        """The relay this process holds, after taking the lease if it has run out."""
        task = self._task
        if task is not None and task.done() and not task.cancelled():
            task.result()  # a relay that died of anything but its lease or a cancel: raise it
        if self.holds():
            return self.relay
        lease = await RelayLease.take(self.driver, self.tasks, self.worker_id)
        return None if lease is None else self._start(lease)

    def stand_by(self, relay_id: str) -> None:
        """The relay ``relay_id`` asked this worker to stand by for it: watch it (once at a
        time) until it takes the lease over (``taken_over``) or the post or the lease is
        another's."""
        if self._standby is None or self._standby.done():
            self._standby = asyncio.create_task(self._stand_by(relay_id), name="mtask-standby")

    async def _stand_by(self, relay_id: str) -> Relay | None:
        try:
            lease = await Standby(self.driver, self.tasks, self.worker_id, relay_id).watch()
        except Exception:  # a bug: logged, and the relay asks another worker
            log.exception("standing by for the relay failed")
            return None
        if lease is None:
            return None
        self.took_over += 1
        self.taken_over.set()  # its relay lets this worker's inbox go: it moves at once
        return self._start(lease)

    def _start(self, lease: RelayLease) -> Relay:
        log.info("this worker holds the relay of the shared change stream")
        waiters = GroupWaiters()  # the dispatcher fills it, the relay tells them
        dispatcher = Dispatcher.build(
            self.driver,
            self.clock,
            new_queue=self.new_queue,
            sweep_interval=self.sweep_interval,
            waiters=waiters,
        )
        relay = Relay(
            self.database,
            self.driver.collections["inboxes"].database,  # the inbox database
            self.tasks,
            self.worker_id,
            self.buffer,
            dispatcher,
            dispatcher.host,
            lease,
            waiters,
        )
        self.relay = relay
        self._task = relay.start()
        return relay

    async def stop(self) -> None:
        for task in (self._standby, self._task):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    def state(self) -> dict[str, Any] | None:
        """The relay's counters, while this process holds it."""
        if self.relay is None or not self.holds():
            return None
        return self.relay.state()
