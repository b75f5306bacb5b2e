"""Holding the relay: a worker process takes the relay's lease when it has run out, and runs
the relay (``relay.Relay``) beside its own worker until it loses the lease or stops."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from mtask import driver
from mtask.clock import Clock
from mtask.worker.claiming.queue import ClaimQueue
from mtask.worker.finding.shared.dispatch import Dispatcher
from mtask.worker.finding.shared.relay import Relay

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
        self._task: asyncio.Task[None] | None = None

    def holds(self) -> bool:
        """Whether this process holds the relay now."""
        return self._task is not None and not self._task.done()

    async def take_if_free(self) -> Relay | None:
        """The relay this process holds, after taking the lease if it has run out."""
        task = self._task
        if task is not None and task.done() and not task.cancelled():
            task.result()  # a relay that died of anything but its lease or a cancel: raise it
        if self.holds():
            return self.relay
        dispatcher = Dispatcher.build(
            self.driver, self.clock, new_queue=self.new_queue, sweep_interval=self.sweep_interval
        )
        relay = await Relay.acquire(
            self.driver, self.database, self.tasks, self.worker_id, self.buffer, dispatcher
        )
        if relay is None:
            return None
        log.info("this worker holds the relay of the shared change stream")
        self.relay = relay
        self._task = asyncio.create_task(relay.run(self.driver), name="mtask-relay")
        return relay

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def state(self) -> dict[str, Any] | None:
        """The relay's counters, while this process holds it."""
        if self.relay is None or not self.holds():
            return None
        return {
            **self.relay.dispatcher.stats(),
            "direct": self.relay.direct is not None,
            "dropped": self.relay.dropped,
            "restarts": self.relay.restarts,
        }
