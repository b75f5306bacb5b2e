"""The flow sweep: what a crash or a race left undone in flows, done later.

Each round publishes the outboxes (next steps) older than one interval that no worker flushed
(it died between recording a success and publishing its steps), and resolves the dependencies
whose dependency's worker did not (it claimed before the dependent was published), and gives
finished flow parents whose steps all ended their ``expire_at`` (``retention.release_parents``).
It also counts the children of parents that waited a round without a wake-up, and wakes those
whose children all finished (``store.children.sweep``): each such parent is counted
at most once a minute.
The
outcome writer does both at once in the normal case; this sweep only makes them certain.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from typing import ClassVar

from mtask.clock import Clock
from mtask.driver import AsyncDriver
from mtask.store import children as store_children
from mtask.store import flows as store_flows
from mtask.store.retention import release_parents
from mtask.worker.service import PeriodicService

CHILDREN_RECHECK_S = 60.0
"""A waiting parent's children are counted by the sweep at most this often."""


class FlowSweep(PeriodicService):
    name: ClassVar[str] = "flows"
    failure: ClassVar[str] = "flow sweep failed, will retry"
    logger: ClassVar[str | None] = "mtask.worker.flow_sweep"  # the name operators filter on, kept

    def __init__(
        self,
        driver: AsyncDriver,
        clock: Clock,
        interval: float,
        leads: Callable[[], bool] = lambda: True,
    ) -> None:
        self.driver = driver
        self.clock = clock
        self.interval = interval
        self.leads = leads
        """Whether this worker sweeps now: with the shared stream, only the relay's (one
        sweep for the cluster, not one per worker); with own streams, every worker."""

    async def run_once(self) -> None:
        if not self.leads():
            return
        now = self.clock.now()
        stale = now - dt.timedelta(seconds=self.interval)
        steps = await self.driver.run(store_flows.flush_outboxes(None, now, older_than=stale))
        await self.driver.run(store_flows.after_publish(steps, now))
        await self.driver.run(
            store_flows.resolve(await self.driver.run(store_flows.awaited()), now)
        )
        await self.driver.run(release_parents(now))  # flow parents held for steps
        # a parent whose children's last count was lost is woken here
        recheck = now - dt.timedelta(seconds=max(CHILDREN_RECHECK_S, self.interval))
        await self.driver.run(store_children.sweep(stale, recheck))
        # the children a cancelled parent's run published after its cancel and then died
        await self.driver.run(store_children.sweep_cancelled(now))
