"""What becomes of a key of a limited batch that a limit refused (``LimitRefusals``).

It gives back the slots it got, and waits for the first slot that refused it (the gate's
``block``, once its batch settles), unless that slot's limit is lossy (``overflow="drop"`` or
``"fail"``): then it is shed, dropped or failed at once (``store.overflow.shed``), fenced so
that a key claimed or moved meanwhile is left alone. A back-off's hold that refused it is no
excess: it waits.
"""

from __future__ import annotations

import datetime as dt
import logging

from mtask import metrics
from mtask.driver import AsyncDriver
from mtask.errors import StorageError
from mtask.limits import rules as limits
from mtask.limits import slots
from mtask.limits.holds import held_until
from mtask.store import overflow
from mtask.worker.claiming import limited
from mtask.worker.claiming.claim_calls import RETRY_SOON
from mtask.worker.claiming.gate import LimitGate
from mtask.worker.finding.protocols import QueueSink
from mtask.worker.running.protocols import RunStarter

log = logging.getLogger("mtask.worker.claiming.claimer")  # the name operators filter on, kept


class LimitRefusals:
    """The keys a limit refused in a batch of limited claims."""

    def __init__(self, driver: AsyncDriver, gate: LimitGate, sink: QueueSink, runs: RunStarter):
        self.driver = driver
        self.gate = gate
        self.sink = sink
        self.runs = runs
        """Where a slot of a run not claimed is given back (``RunStarter.give_back``)."""

    def refused(
        self,
        key: str,
        got: list[tuple[slots.Request, slots.Taken]],
        now: dt.datetime,
        waits: list[limited.Wait],
        shed: dict[tuple[str, str], list[str]],
    ) -> None:
        """``key`` was refused a slot: it gives back those it got, and waits for the first
        that refused it (``waits``), or, refused by a lossy limit, is shed (``shed``: by what
        becomes of it and the slot that refused it)."""
        for request, t in got:
            if t.taken and t.limited:
                self.runs.give_back(request.slot, request.run_id)
        request, refusal = next((r, t) for r, t in got if not t.taken)
        how = self._overflow(request, now)
        if how != "queue":  # a lossy limit: the excess does not wait
            shed.setdefault((how, request.slot), []).append(key)
            return
        waits.append(limited.Wait(key, request.slot, refusal.retry_at))

    def _overflow(self, request: slots.Request, now: dt.datetime) -> str:
        """What the limit of ``request``'s slot does with a task it refused: a lossy limit's
        ``drop`` or ``fail``, unless a back-off's hold refused it (that is no excess)."""
        slot = request.slot
        owner = slot if limits.is_resource(slot) else slot.partition(limits.GROUP_SEPARATOR)[0]
        doc = self.gate.limited.get(owner)
        if doc is None or held_until(doc, request.group, now) is not None:
            return "queue"
        return limits.overflow_of(doc)

    async def shed(self, keys: list[str], how: str, slot: str, now: dt.datetime) -> None:
        """Drop or fail ``keys``, which the lossy limit of ``slot`` refused (a key claimed or
        moved meanwhile is left alone); read again, so the finished ones are forgotten."""
        if limits.is_resource(slot):
            what = f"resource `{limits.resource_of(slot)}`"
        elif limits.is_group_slot(slot):
            name, _, group = slot.partition(limits.GROUP_SEPARATOR)
            what = f"group `{group}` of `{name}`"
        else:
            what = f"`{slot}`"
        verb = "dropped" if how == "drop" else "failed"
        why = f"{verb}: the limit of {what} was full (overflow={how})"
        try:
            shed = await self.driver.run(overflow.shed(keys, how, why, now))
        except StorageError as exc:
            log.warning("cannot shed %d task(s) a full limit refused: %s", len(keys), exc)
            for key in keys:
                self.sink.requeue_at(key, now + RETRY_SOON)
            return
        log.info("%s %d task(s): the limit of %s was full", verb, shed, what)
        owner = slot.partition(limits.GROUP_SEPARATOR)[0]  # a group's limit is its name's
        limit = f"resource:{limits.resource_of(slot)}" if limits.is_resource(slot) else owner
        metrics.LIMIT_SHED.labels(limit=limit, how=how).inc(shed)
        await self.sink.requeue(keys, later_than=now)
