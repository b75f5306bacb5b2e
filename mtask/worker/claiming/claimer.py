"""The claim path (River's producer): which keys to claim, claiming them, and what a claim
that failed or missed leaves to do.

``run`` is the worker's main loop. It waits on ``wake | timer``, and claims only for free
slots and the runs its ``ClaimAhead`` allows beyond them (ahead.py), only while at most as
many outcomes wait to be written (so a worker holds at most twice that in leases: runs running
or claimed ahead, and finished runs whose outcome is on its way).

Groups and limits are decided here, in one place: the ``LimitGate`` splits the keys popped
(``partition``) between the claimer's two strategies, each with ``claim(keys, names, now)``:

- ``PlainClaims`` (plain.py): the keys of names under no cluster-wide limit, in one round trip
  per batch (``store.claim`` through ``ClaimCalls``), inline;
- ``LimitedClaims`` (limited_claims.py): the keys of limited names, in batches of their own
  beside the loop, after their slots and tokens (and a sequence's head in a key's place).

Both hand what they claimed to one ``Starter`` (start.py), the one place runs start.

Ownership: every field is the event loop's. Keys are ``InFlight.claiming`` from the moment a
claim is sent until its runs have started, so the claim's own change events cannot queue them.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import time
from typing import ClassVar

from mtask.clock import Clock
from mtask.worker.claim_queue import ClaimQueue
from mtask.worker.claiming.ahead import ClaimAhead
from mtask.worker.claiming.claim_calls import ClaimCalls
from mtask.worker.claiming.gate import LimitGate
from mtask.worker.claiming.limited_claims import LimitedClaims
from mtask.worker.claiming.plain import PlainClaims
from mtask.worker.claiming.start import Starter
from mtask.worker.finding.protocols import QueueSink
from mtask.worker.inflight import InFlight
from mtask.worker.presence import Assignment, Lifecycle
from mtask.worker.running.protocols import RunStarter
from mtask.worker.stats import WorkerStats


class Claimer:
    name: ClassVar[str] = "claimer"

    def __init__(
        self,
        clock: Clock,
        calls: ClaimCalls,
        limited: LimitedClaims,
        *,
        concurrency: int,
        ahead: ClaimAhead,
        queue: ClaimQueue,
        inflight: InFlight,
        assignment: Assignment,
        sink: QueueSink,
        gate: LimitGate,
        runs: RunStarter,
        stats: WorkerStats,
        lifecycle: Lifecycle,
        wake: asyncio.Event,
    ) -> None:
        self.clock = clock
        self.limited = limited
        """The second strategy: keys of limited names, in batches beside the loop."""
        self.plain = PlainClaims(
            calls,
            clock,
            queue=queue,
            inflight=inflight,
            sink=sink,
            ahead=ahead,
            starter=Starter(runs, sink, stats),
            stats=stats,
        )
        """The first strategy: keys of names under no limit, in one claim inline."""
        self.concurrency = concurrency
        self.ahead = ahead
        """How many runs may be claimed beyond ``concurrency`` (claiming/ahead.py)."""
        self.queue = queue
        self.inflight = inflight
        self.assignment = assignment
        self.sink = sink
        self.gate = gate
        self.runs = runs
        """The run side: claimed documents start there (``RunStarter``)."""
        self.stats = stats
        self.lifecycle = lifecycle
        self.wake = wake
        """Set by whoever may have made a claim possible: the finding parts (a task queued), the
        executor and the recorder (a slot freed), ``Worker.stop``."""

    async def run(self) -> None:
        """The main loop: until the worker stops, claim what is due for the free slots."""
        try:
            await self._loop()
        finally:  # the limited batches on their way start their runs, or are cancelled
            if self.limited.batches:
                await asyncio.wait(self.limited.batches)

    async def _loop(self) -> None:
        while self.lifecycle.state == "running":
            self.wake.clear()
            claimed, timeout = await self.run_once()
            if claimed:
                # the runs just claimed take their first step before the next pass (W2)
                await asyncio.sleep(0)
                continue
            # asyncio.timeout waits on the event itself; wait_for would wrap it in a task,
            # costing two more event-loop turns between a wake-up and the claim (W2 latency)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self.wake.wait()

    def capacity(self) -> int:
        """How many more tasks this worker can take now (``--stream shared``: its credit):
        its slots and the runs it may claim ahead, less its runs, its claims on their way, the
        outcomes not yet written and the due keys in its queue. (A written success gives its
        slot back to the relay by its event, and the relay counts it:
        ``finding.shared.credit``.)"""
        if self.lifecycle.state != "running":
            return 0
        busy = self.inflight.load + self.runs.unwritten + self.queue.due(self.clock.now())
        return self.concurrency + self.ahead.allowed() - busy

    async def run_once(self) -> tuple[bool, float | None]:
        """Claim once if a slot is free and a key due. Returns whether it claimed, and how
        long to sleep at most until the next key is due (``None``: until woken). The lock
        slots kept for a handover before this pass and not used in it are given back."""
        started = time.monotonic()
        try:
            return await self._pass()
        finally:
            before = started if not self.limited.batches else float("-inf")
            kept = self.limited.releases.unused(before)
            for slot, run_ids in kept.items():
                for run_id in run_ids:
                    self.runs.give_back(slot, run_id)

    async def _pass(self) -> tuple[bool, float | None]:
        if self.limited.failure is not None:
            raise self.limited.failure
        slots = self.concurrency + self.ahead.allowed()
        free = slots - len(self.inflight) - self.limited.pending
        names = self.assignment.active
        # Backpressure: claim only while at most `slots` outcomes wait to be written, so a
        # worker holds at most 2 x slots leases (running handlers and runs claimed ahead, plus
        # finished runs whose outcome is on its way). Counting the runs claimed ahead here
        # lets the next claim go while a batch's outcomes are written: with `concurrency`,
        # a batch of `slots` runs that ended would hold the claimer until they were written.
        if free <= 0 or not names or self.runs.unwritten > slots:
            return False, None
        now = self.clock.now()
        keys = self.queue.pop_due(now, free)
        if keys:
            if self.queue.wants_top_up():
                self.sink.request_top_up()
            await self.claim(keys, names, now)
            return True, None
        if self.queue.needs_refill(now):
            self.sink.request_rescan()
        wake_at = min(
            (t for t in (self.queue.next_due(now), self.queue.overflow_at) if t), default=None
        )
        return False, None if wake_at is None else max(0.0, (wake_at - now).total_seconds())

    async def claim(self, keys: list[str], names: list[str], now: dt.datetime) -> None:
        """Claim ``keys`` (found due at ``now``) for ``names``, and start the runs claimed:
        the keys of limited names by the limited strategy (``claim_soon``: beside the loop),
        the others by one plain claim for the names under no limit (which never matches a
        limited key)."""
        split = self.gate.partition(keys, names)
        # the plain claim first, with no wait between the split and its claim: a limit that
        # changes meanwhile finds it on its way (``InFlight.claims_before``), never after
        if split.plain and split.names:
            await self.plain.claim(split.plain, split.names, now)
        elif split.plain:  # keys whose name we no longer know: look them up again
            await self.sink.requeue(split.plain)
        if split.limited:
            await self.limited.claim_soon(split.limited, names, now)
