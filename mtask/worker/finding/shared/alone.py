"""A worker's own finding while no relay hands it its tasks (``subscriber.SubscriberState``'s
``OWN_STREAM``, ``RELAY_EVENTS`` and ``FOR_GOOD``): its sweep and top-up, with a change stream of
its own unless the relay passes it the task events. It runs until stopped: anything else that
ends it is a bug, handed to ``broke`` (the shared stream stops with it, supervised: a worker
must not go on finding nothing)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from mtask.worker.finding.finder import Finder
from mtask.worker.finding.protocols import ClaimsBack
from mtask.worker.finding.scan import Sweep, TopUp
from mtask.worker.finding.stream import OwnStream


class FindingAlone:
    def __init__(
        self,
        finder: Finder,
        database: Any,
        tasks: str,
        worker_id: str,
        claims: ClaimsBack | None,
        broke: Callable[[BaseException], None],
    ) -> None:
        self.finder = finder
        self.database = database
        self.tasks = tasks
        self.worker_id = worker_id
        self.claims = claims
        self.broke = broke
        self._task: asyncio.Task[None] | None = None
        self._own = False
        """Whether it follows an own stream."""

    def start(self, own_stream: bool) -> None:
        """Find work alone (``own_stream``: with an own stream), unless it does so already."""
        if self._task is not None and not self._task.done() and self._own == own_stream:
            return
        self.finder.others.control()  # the heartbeat reads the peers (the stagger), pauses now
        self.stop()
        self._own = own_stream
        self._task = asyncio.create_task(self._run(own_stream), name="mtask-alone")
        self._task.add_done_callback(self._done)

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    def _done(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and (exc := task.exception()) is not None:
            self.broke(exc)

    async def _run(self, own_stream: bool) -> None:
        async with asyncio.TaskGroup() as group:
            group.create_task(Sweep.of(self.finder.scanner).run())
            group.create_task(TopUp(self.finder.scanner).run())
            if own_stream:
                own = OwnStream(self.database, self.tasks, self.worker_id, self.finder, self.claims)
                group.create_task(own.run())
