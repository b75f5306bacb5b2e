"""What follows outcomes once they are written (``FollowUps.after``): each step best effort,
each one the flow sweep does later if it fails (``worker/maintenance/flow_sweep.py``).

- a finished task's output and the step results it stored aside are sealed: their retention
  becomes the task's (docs/output.md, docs/steps.md);
- spawned children that finished for good are counted on their parents, which wake once their
  count is full (``store.children.count_finished``);
- the next steps of the successes that returned some are published (their outbox flushed),
  and the tasks that depend on these released or failed (``flows``).
"""

from __future__ import annotations

import logging

from mtask.clock import Clock
from mtask.driver import AsyncDriver
from mtask.errors import StorageError
from mtask.store import Outcome, RunState
from mtask.store import children as store_children
from mtask.store import flows as store_flows
from mtask.store import output as store_output
from mtask.store import steps as store_steps

log = logging.getLogger("mtask.worker.running.recorder")  # the name operators filter on, kept


class FollowUps:
    """The follow-up of the outcomes the ``OutcomeRecorder`` wrote."""

    def __init__(self, driver: AsyncDriver, clock: Clock) -> None:
        self.driver = driver
        self.clock = clock

    async def _count_children(self, batch: list[Outcome]) -> None:
        """Spawned children that may have finished for good: counted on their parents, which
        wake once their count is full. If this fails, the flow sweep recounts."""
        ended = [
            o.key
            for o in batch
            if o.child_of is not None
            and o.state
            not in (RunState.WAITING, RunState.RELEASED, RunState.SNOOZED, RunState.CONTINUED)
        ]
        if not ended:
            return
        try:
            await self.driver.run(store_children.count_finished(ended))
        except StorageError as exc:
            log.warning("children not counted on their parents; the flow sweep will: %s", exc)

    async def after(self, batch: list[Outcome]) -> None:
        """After outcomes are recorded: publish the next steps of the successes that returned
        some, and release or fail the tasks that depend on these. If this fails, the flow
        sweep does it later (the outboxes and the awaited dependencies stay in MongoDB)."""
        parents = [o.key for o in batch if o.steps]
        watched = [o.key for o in batch if o.has_dependents]
        with_output = [o.key for o in batch if o.has_output]
        if with_output:
            try:  # their output's retention becomes the finished task's (docs/output.md)
                await self.driver.run(store_output.seal(with_output))
            except StorageError as exc:
                log.warning("output kept until its own expiry, not sealed: %s", exc)
        with_spills = [o.key for o in batch if o.has_spills]
        if with_spills:
            try:  # results stored aside go with their finished task (docs/steps.md)
                await self.driver.run(store_steps.seal(with_spills))
            except StorageError as exc:
                log.warning("step results kept until their own expiry, not sealed: %s", exc)
        await self._count_children(batch)
        if not parents and not watched:
            return
        now = self.clock.now()
        try:
            if parents:
                steps = await self.driver.run(store_flows.flush_outboxes(parents, now))
                await self.driver.run(store_flows.after_publish(steps, now))
            if watched:
                await self.driver.run(store_flows.resolve(watched, now))
        except StorageError as exc:
            log.warning("next steps or dependents wait for the flow sweep: %s", exc)
