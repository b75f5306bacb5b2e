"""Claims of keys whose names are under a cluster-wide limit (``LimitedClaims``).

A batch of them is claimed after its slots and tokens: the heads of their sequences read
(``store.heads``), every slot they need taken in one bulk write (``slots.take``, through the
``LimitGate``), then the keys whose slots were all granted claimed together, a sequence's head
with its group's lock. A key a limit holds back waits for its slot (``LimitGate.block``). Such a
batch costs more round trips than a plain one, so it runs beside the claimer's main loop, at
most ``LIMITED_IN_FLIGHT`` at once (``claim_soon``); its keys count as taken meanwhile
(``pending``).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import time
import uuid
from typing import Any

from mtask import limits, slots, store
from mtask.clock import Clock
from mtask.driver import AsyncDriver
from mtask.errors import StorageError
from mtask.models import WORKER_TIMEOUT_MS, in_range
from mtask.worker.claiming import limited
from mtask.worker.claiming.calls import RETRY_SOON, ClaimCalls
from mtask.worker.claiming.gate import DEFAULT_SLOT_LEASE_MS, LimitGate
from mtask.worker.finding.protocols import QueueSink
from mtask.worker.inflight import InFlight
from mtask.worker.running.protocols import RunStarter
from mtask.worker.stats import WorkerStats

log = logging.getLogger("mtask.worker.claiming.claimer")  # the name operators filter on, kept

LIMITED_IN_FLIGHT = 2
"""Batches of limited keys being claimed at once (``LimitedClaims.claim_soon``)."""


class LimitedClaims:
    """The worker's claims of limited keys, batch by batch beside its main loop."""

    def __init__(
        self,
        driver: AsyncDriver,
        calls: ClaimCalls,
        clock: Clock,
        *,
        gate: LimitGate,
        sink: QueueSink,
        inflight: InFlight,
        runs: RunStarter,
        stats: WorkerStats,
        wake: asyncio.Event,
    ) -> None:
        self.driver = driver
        self.calls = calls
        self.clock = clock
        self.gate = gate
        self.sink = sink
        self.inflight = inflight
        self.runs = runs
        self.stats = stats
        self.wake = wake
        """Set when a batch ends: its keys no longer count as taken."""
        self.batches: set[asyncio.Task[None]] = set()
        self.pending = 0
        """Keys in the batches on their way (``claim_soon``)."""
        self.failure: BaseException | None = None
        """What a batch raised: the claimer's main loop raises it (the worker stops)."""

    async def claim_soon(self, keys: list[str], names: list[str], now: dt.datetime) -> None:
        """``claim`` in the background, at most ``LIMITED_IN_FLIGHT`` batches at once:
        a batch of limited keys costs more round trips than a plain one (the heads, the slots),
        and the next batch need not wait for them. Its keys count as taken meanwhile."""
        while len(self.batches) >= LIMITED_IN_FLIGHT:
            await asyncio.wait(self.batches, return_when=asyncio.FIRST_COMPLETED)
        self.pending += len(keys)

        async def batch() -> None:
            try:
                await self.claim(keys, names, now)
            finally:
                self.pending -= len(keys)
                self.wake.set()

        task = asyncio.create_task(batch(), name="mtask-claim-limited")
        self.batches.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self.batches.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            self.failure = exc  # raised by the main loop: the worker stops, as for its own

    async def claim(self, keys: list[str], names: list[str], now: dt.datetime) -> None:
        """Claim ``keys`` of limited names (found due at ``now``) as one batch: the heads of
        their sequences read, then every slot they need taken in one bulk write
        (``slots.take``), then the keys whose slots were all granted claimed together. A key a
        limit holds back waits for its slot (``LimitGate.block``)."""
        known = {k: m for k in keys if (m := self.sink.known(k)) is not None}
        pairs = limited.sequences(keys, known, self.gate.limited)
        heads: dict[tuple[str, str], dict[str, Any]] = {}
        if pairs:
            try:
                heads = await self.driver.run(store.heads(pairs))
            except StorageError as exc:
                log.warning("cannot read the sequences' next tasks, retrying shortly: %s", exc)
                for key in keys:
                    self.sink.requeue_at(key, now + RETRY_SOON)
                return
        batch = uuid.uuid4().hex
        # The leases and slots of this batch end at `now` + their timeouts: `now` is read
        # after `sent` (and after the waits above: for a batch's turn, for the heads), so none
        # ends before `sent` + its timeout by this process's clock, when a run's local
        # deadline falls.
        sent = time.monotonic()
        now = self.clock.now()
        plan = limited.plan(
            keys,
            known,
            self.gate.limited,
            heads,
            now,
            lambda key: store.run_id_for(batch, key),
            DEFAULT_SLOT_LEASE_MS,
        )
        waits = list(plan.waits)
        # a lock slot of this worker's ended run goes straight to the run that waited for it
        claims = [(key, [self.gate.hand_over(r) for r in rs]) for key, rs in plan.claims]
        candidates = [key for key, _ in claims]
        requeue: list[str] = []
        missed: list[str] = []
        with self.inflight.claiming(candidates):
            requests = [r for _, rs in claims for r in rs]
            taken = await self.gate.take(requests, now) if requests else []
            if taken is None:
                requeue = candidates
                for r in requests:  # taken or not: given back (a release of nothing is none)
                    for run_id in filter(None, (r.run_id, r.replaces)):
                        self.runs.give_back(r.slot, run_id)
            else:
                go, held, tokens = self._granted(claims, taken, waits)
                hints = {
                    first: t
                    for h in heads.values()
                    if isinstance(first := h.get("_id"), str)
                    and in_range(t := h.get("worker_timeout_ms"), WORKER_TIMEOUT_MS)
                }
                missed = await self._claim_granted(
                    go, held, tokens, plan, names, now, sent, batch, hints, waits, requeue
                )
        for wait in waits:  # no longer claiming: they may be queued again
            self.gate.block(wait.slot, wait.key, wait.until, now)
        for key in requeue:
            self.sink.requeue_at(key, now + RETRY_SOON)
        if plan.gone or missed:
            await self.sink.requeue([*plan.gone, *missed], later_than=now)
        if plan.unknown:  # forgotten on the way (a switch to the relay's hand-outs clears them)
            await self.sink.requeue(plan.unknown)

    def _granted(
        self,
        claims: list[tuple[str, list[slots.Request]]],
        taken: list[slots.Taken],
        waits: list[limited.Wait],
    ) -> tuple[list[str], dict[str, tuple[str, ...]], dict[str, frozenset[str]]]:
        """The keys whose slots were all granted, the slots each holds, and those of them it
        was only granted a token of (``slots.Taken.holder``); the others give back what they
        got and wait for the slot that refused them."""
        results = iter(taken)
        go: list[str] = []
        held: dict[str, tuple[str, ...]] = {}
        tokens: dict[str, frozenset[str]] = {}
        for key, requests in claims:
            got = [(r, next(results)) for r in requests]
            for request, t in got:
                if request.replaces is not None and not t.taken:  # still the ended run's
                    self.runs.give_back(request.slot, request.replaces)
            if all(t.taken for _, t in got):
                go.append(key)
                held[key] = tuple(r.slot for r, t in got if t.limited)
                tokens[key] = frozenset(r.slot for r, t in got if t.limited and not t.holder)
                continue
            for request, t in got:
                if t.taken and t.limited:
                    self.runs.give_back(request.slot, request.run_id)
            request, refusal = next((r, t) for r, t in got if not t.taken)
            waits.append(limited.Wait(key, request.slot, refusal.retry_at))
        return go, held, tokens

    async def _claim_granted(
        self,
        keys: list[str],
        held: dict[str, tuple[str, ...]],
        tokens: dict[str, frozenset[str]],
        plan: limited.Plan,
        names: list[str],
        now: dt.datetime,
        sent: float,
        batch: str,
        hints: dict[str, int],
        waits: list[limited.Wait],
        requeue: list[str],
    ) -> list[str]:
        """Claim ``keys`` (their slots taken for this batch's run ids) and start the runs —
        a sequence's head with its group's lock (``plan.locked``); one whose group's lock is
        held waits for it (``waits``), one MongoDB failed to claim is tried again shortly
        (``requeue``; both once no longer claiming). The slots of keys not claimed are given
        back. Returns the keys missed."""
        if not keys:
            return []
        self.stats.claim_calls += 1
        self.stats.claim_attempts += len(keys)
        hints = {**hints, **self.sink.timeouts(keys)}  # a sequence's head may be unknown here
        plain = [k for k in keys if k not in plan.locked]
        heads = [k for k in keys if k in plan.locked]
        docs: list[dict[str, Any]] = []
        failed: list[str] = []
        if plain:
            got = await self.calls.send(
                plain, names, now, hints, isolate_on_error=False, batch=batch
            )
            docs += got or []
            failed += plain if got is None else []
        busy: set[str] = set()
        if heads:
            pairs = {k: limits.lock_group(plan.locked[k]) for k in heads}
            locked = await self.calls.send_locked(pairs, names, now, batch)
            docs += locked[0] if locked else []
            busy = locked[1] if locked else set()
            failed += heads if locked is None else []
        for doc in docs:
            key = doc["_id"]
            self.gate.unblock([key])
            lock = plan.locked.get(key)
            runs_in = held.get(key, ()) + ((lock,) if lock else ())
            self.runs.start(doc, sent, runs_in, tokens.get(key, frozenset()))
            self.sink.claimed(doc)
            self.stats.claimed += 1
        claimed = {d["_id"] for d in docs}
        for key in keys:
            if key not in claimed:
                for slot in held.get(key, ()):
                    self.runs.give_back(slot, store.run_id_for(batch, key))
        waits += [limited.Wait(k, plan.locked[k]) for k in busy]  # another task holds it
        requeue += failed
        gone = claimed | busy | set(failed)
        return [k for k in keys if k not in gone]
