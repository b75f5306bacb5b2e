"""The claim of keys under no cluster-wide limit (``PlainClaims``): the claimer's first
strategy, one batch claim inline in its main loop.

One round trip per batch (``store.claim`` through ``ClaimCalls``); the documents claimed start
their runs in the queue's order (``Starter``); a key missed goes back in the queue only if it
was not due yet when the claim was sent. The other strategy, for names under a limit, is
``limited_claims.LimitedClaims``.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import time

from mtask import metrics
from mtask.clock import Clock
from mtask.tracing import span
from mtask.worker.claim_queue import ClaimQueue
from mtask.worker.claiming.ahead import ClaimAhead
from mtask.worker.claiming.claim_calls import RETRY_SOON, ClaimCalls
from mtask.worker.claiming.start import Starter
from mtask.worker.finding.protocols import QueueSink
from mtask.worker.inflight import InFlight
from mtask.worker.stats import WorkerStats

FAILED_PAUSE = 0.5
"""Seconds the main loop pauses after a claim call MongoDB failed (its keys wait a second)."""


class PlainClaims:
    """The claims of one worker's unlimited keys."""

    def __init__(
        self,
        calls: ClaimCalls,
        clock: Clock,
        *,
        queue: ClaimQueue,
        inflight: InFlight,
        sink: QueueSink,
        ahead: ClaimAhead,
        starter: Starter,
        stats: WorkerStats,
    ) -> None:
        self.calls = calls
        self.clock = clock
        self.queue = queue
        self.inflight = inflight
        self.sink = sink
        self.ahead = ahead
        self.starter = starter
        self.stats = stats

    async def claim(self, keys: list[str], names: list[str], now: dt.datetime) -> None:
        """Claim ``keys`` (found due at ``now``) for ``names`` in one call, and start the runs
        claimed."""
        self.stats.claim_calls += 1
        self.stats.claim_attempts += len(keys)
        hints = self.sink.timeouts(keys)
        # From here the keys count as in flight: the claim's own change events may arrive
        # before its reply, and must not put the keys back in the queue.
        with self.inflight.claiming(keys):
            # The claim's leases end at `now` + their timeout: `now` is read after `sent`, so
            # none ends before `sent` + its timeout by this process's clock, when the run's
            # local deadline falls.
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
                self.starter.start(docs, sent)
        if docs is None:
            await asyncio.sleep(FAILED_PAUSE)
            return
        claimed = {d["_id"] for d in docs}
        missed = [k for k in keys if k not in claimed]
        if missed:
            # A key we did not get goes back only if it was not yet due when we tried (our
            # clock may be a millisecond early); otherwise another worker has it, or we may not
            # run it, and an event or the sweep brings it back when that changes.
            await self.sink.requeue(missed, later_than=now)
