"""The runs in flight counted again when a limit changes (``Recount``), and the worker's word
that it applies the change (``Event.LIMITS_APPLIED``).

The ``LimitGate`` reads a name's limit at once when its change event comes, and tells this
part the name (``changed``) once its claims go by the new limit. The part then waits for the
claims begun before (planned under the old limit: their runs start, or they took nothing),
has every run of the name in flight take a place in each slot the new limit counts that it
holds none in (``limited.counted``; ``store_slots.join``, one bulk write), and says so. From then on
the slots hold every run of this worker in flight: a lowered limit starts no run while the
runs in flight exceed it (they finish), a limit set where there was none counts the runs that
started without it, and a group given a limit of runs at once counts its sequence's running
task. One write per worker per change, and none while no limit changes.
"""

from __future__ import annotations

import asyncio
import logging
from typing import ClassVar

from mtask.clock import Clock
from mtask.driver import AsyncDriver
from mtask.errors import StorageError
from mtask.limits import rules as limits
from mtask.limits import slots
from mtask.store import slots as store_slots
from mtask.worker.claiming.gate import LimitGate
from mtask.worker.claiming.limited import counted
from mtask.worker.inflight import InFlight
from mtask.worker.running.protocols import RunStarter
from mtask.worker.wiring import Signal
from mtask.worker.worker_events import Emitter, Event

log = logging.getLogger(__name__)

CLAIMS_WITHIN = 10.0
"""Seconds a change waits at most for the claims begun before it (a claim call takes at most
``store.claims.CLAIM_TIMEOUT_S``; a batch of limited keys a few of them)."""
RETRY_AFTER = 1.0
"""Seconds before the runs are counted in again after MongoDB failed to."""


class Recount:
    """Counts this worker's runs in flight towards each changed limit, then says so."""

    name: ClassVar[str] = "recount"

    def __init__(
        self,
        driver: AsyncDriver,
        clock: Clock,
        worker_id: str,
        *,
        gate: LimitGate,
        inflight: InFlight,
        runs: RunStarter,
        emit: Emitter,
        changed: Signal[[str]],
    ) -> None:
        self.driver = driver
        self.clock = clock
        self.worker_id = worker_id
        self.gate = gate
        self.inflight = inflight
        self.runs = runs
        self.emit = emit
        changed.connect(self.changed)  # the gate applied a changed limit
        self.names: dict[str, int] = {}
        """Names whose limit changed, each with the mark of the claims begun before."""
        self.wake = asyncio.Event()

    def changed(self, name: str) -> None:
        """``name``'s limit changed, and the gate's view of it is the new one."""
        self.names[name] = self.inflight.claims_mark()
        self.wake.set()

    async def run(self) -> None:
        while True:
            await self.wake.wait()
            self.wake.clear()
            await self.apply_changes()

    async def apply_changes(self) -> None:
        """Count the runs in flight in towards the limits changed so far, and say so."""
        names, self.names = self.names, {}
        if not names:
            return
        await self.inflight.claims_before(max(names.values()), CLAIMS_WITHIN)
        try:
            await self.count_in(set(names))
        except StorageError as exc:
            log.warning("cannot count the runs in flight towards a changed limit: %s", exc)
            for name, mark in names.items():  # tried again shortly
                self.names.setdefault(name, mark)
            asyncio.get_running_loop().call_later(RETRY_AFTER, self.wake.set)
            return
        for name in sorted(names):  # a slot's _id holds a NUL: a log line must not
            self.emit(Event.LIMITS_APPLIED, name=limits.slot_label(name))

    async def count_in(self, names: set[str]) -> None:
        """Every run in flight of ``names`` takes a place in each slot its name's limit counts
        that it holds none in (one write); the runs that ended meanwhile give it back."""
        requests = [
            slots.Request(
                slot,
                run.run_id,
                run.key,
                run.lease_ms,
                limit,
                units=self.gate.units.get(run.name, 1),
            )
            for run in list(self.inflight.runs.values())
            if run.name in names and (doc := self.gate.limited.get(run.name)) is not None
            for slot, limit in counted(run.name, run.group, run.slots, doc)
        ]
        requests += [  # and in the shared resources its name uses whose limit changed
            slots.Request(
                resource, run.run_id, run.key, run.lease_ms, units=self.gate.units.get(run.name, 1)
            )
            for run in list(self.inflight.runs.values())
            for resource in self.gate.uses.get(run.name, ())
            if resource in names
            and (doc := self.gate.limited.get(resource)) is not None
            and limits.own_limit(doc).concurrency is not None
        ]
        if not requests:
            return
        await self.driver.run(
            store_slots.join(requests, self.worker_id, self.clock.now(), self.gate.made)
        )
        for request in requests:
            if not self.runs.hold(request.run_id, request.slot):
                self.runs.give_back(request.slot, request.run_id)
