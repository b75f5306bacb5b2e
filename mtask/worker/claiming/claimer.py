"""The claim path (River's producer): which keys to claim, claiming them, and what a claim
that failed or missed leaves to do.

``run`` is the worker's main loop. It waits on ``wake | timer``, and claims only for free
slots and the runs its ``ClaimAhead`` allows beyond them (claim_ahead.py), in one round trip
per batch (``store.claim``), only while at most as many outcomes wait to be written (so a
worker holds at most twice that in leases: runs running or claimed ahead, and finished runs
whose outcome is on its way). Its two collaborators: ``ClaimCalls`` (claim_calls.py: one
claim call, and what a failed one leaves to do) and ``LimitedClaims`` (limited_claims.py: keys
of names under a cluster-wide limit, claimed in batches of their own after their slots and
tokens).

Ownership: every field is the event loop's. Keys are ``InFlight.claiming`` from the moment a
claim is sent until its runs have started, so the claim's own change events cannot queue them.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import time
from typing import ClassVar

from mtask import metrics
from mtask.clock import Clock
from mtask.tracing import span
from mtask.worker.claiming.ahead import ClaimAhead
from mtask.worker.claiming.calls import RETRY_SOON, ClaimCalls
from mtask.worker.claiming.gate import LimitGate
from mtask.worker.claiming.limited_claims import LimitedClaims
from mtask.worker.claiming.queue import ClaimQueue
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
        self.calls = calls
        self.limited = limited
        self.concurrency = concurrency
        self.ahead = ahead
        """How many runs may be claimed beyond ``concurrency`` (claim_ahead.py)."""
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
            kept = self.gate.unused(started if not self.limited.batches else float("-inf"))
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
        """Claim ``keys`` (found due at ``now``) for ``names``, and start the runs claimed."""
        if self.gate.limited:
            # Names with a cluster-wide limit are claimed after their slots were taken; the
            # batch claim below never matches them.
            held = [k for k in keys if (m := self.sink.known(k)) and self.gate.is_limited(m.name)]
            if held:
                await self.limited.claim_soon(held, names, now)
                done = set(held)
                keys = [k for k in keys if k not in done]
            names = [n for n in names if not self.gate.is_limited(n)]
            if not keys:
                return
            if not names:  # keys whose name we no longer know: look them up again
                await self.sink.requeue(keys)
                return
        self.stats.claim_calls += 1
        self.stats.claim_attempts += len(keys)
        hints = self.sink.timeouts(keys)
        # From here the keys count as in flight: the claim's own change events may arrive
        # before its reply, and must not put the keys back in the queue.
        with self.inflight.claiming(keys):
            # The claim's leases end at `now` + their timeout: `now` is read after `sent` (and
            # after any wait for the limited batches above), so none ends before `sent` + its
            # timeout by this process's clock, when the run's local deadline falls.
            sent = time.monotonic()
            now = self.clock.now()
            with span("mtask.claim", keys=len(keys)):
                docs = await self.calls.send(keys, names, now, hints, isolate_on_error=True)
            if docs is None:  # MongoDB failed and nothing was taken: try again shortly
                for key in keys:
                    self.queue.push(key, now + RETRY_SOON)
            else:
                round_trip = time.monotonic() - sent
                metrics.CLAIM_LATENCY.observe(round_trip)
                self.ahead.claimed(round_trip)
                if len(docs) > 1:  # started in the queue's order: the first take the slots
                    order = {key: i for i, key in enumerate(keys)}
                    docs.sort(key=lambda d: order.get(d["_id"], len(order)))
                for doc in docs:
                    self.runs.start(doc, sent)
                    self.sink.claimed(doc)
                self.stats.claimed += len(docs)
        if docs is None:
            await asyncio.sleep(0.5)
            return
        claimed = {d["_id"] for d in docs}
        missed = [k for k in keys if k not in claimed]
        if missed:
            # A key we did not get goes back only if it was not yet due when we tried (our
            # clock may be a millisecond early); otherwise another worker has it, or we may not
            # run it, and an event or the sweep brings it back when that changes.
            await self.sink.requeue(missed, later_than=now)
