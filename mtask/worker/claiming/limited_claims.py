"""Claims of keys whose names are under a cluster-wide limit (``LimitedClaims``): the
claimer's second strategy.

A batch of them is claimed after its slots and tokens: the heads of their sequences read
(``store.heads``; with their groups' slots for a while after a change made them sequences,
``store.heads_and_slots``), every slot they need taken in one bulk write (``store_slots.take``,
through the ``LimitGate``), then the keys whose slots were all granted claimed together, a
sequence's head with its group's lock; their runs start through the claimer's one
``Starter``. A key a limit holds back waits for its slot (``LimitGate.block``), or is shed by a
lossy limit (``limit_refusals.LimitRefusals``). Such a batch
costs more round trips than a plain one, so it runs beside the claimer's main loop, at most
``LIMITED_IN_FLIGHT`` at once (``claim_soon``); its keys count as taken meanwhile
(``pending``).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from mtask import store
from mtask.clock import Clock
from mtask.driver import AsyncDriver
from mtask.errors import StorageError
from mtask.limits import rules as limits
from mtask.limits import slots
from mtask.vocabulary import WORKER_TIMEOUT_MS, in_range
from mtask.worker.claiming import limited
from mtask.worker.claiming.claim_calls import RETRY_SOON, ClaimCalls
from mtask.worker.claiming.gate import DEFAULT_SLOT_LEASE_MS, LimitGate
from mtask.worker.claiming.limit_refusals import LimitRefusals
from mtask.worker.claiming.releases import SlotReleases
from mtask.worker.claiming.start import Held, Starter
from mtask.worker.finding.protocols import QueueSink
from mtask.worker.inflight import InFlight
from mtask.worker.running.protocols import RunStarter
from mtask.worker.stats import WorkerStats

log = logging.getLogger("mtask.worker.claiming.claimer")  # the name operators filter on, kept

LIMITED_IN_FLIGHT = 2
"""Batches of limited keys being claimed at once (``LimitedClaims.claim_soon``)."""

Claims = list[tuple[str, list[slots.Request]]]
"""Keys to claim, each with the slot requests that must all be granted first."""


@dataclass
class _Batch:
    """One batch of limited keys on its way, and what became of each key."""

    id: str
    sent: float
    """When (monotonic) it began, before its time was read: its runs' deadlines count from
    here."""
    now: dt.datetime
    plan: limited.Plan
    hints: dict[str, int]
    """The leases' lengths of the sequences' heads, as read with them."""
    waits: list[limited.Wait] = field(default_factory=list)
    requeue: list[str] = field(default_factory=list)
    """Keys MongoDB failed to claim or take slots for: tried again shortly."""
    missed: list[str] = field(default_factory=list)
    held: dict[str, Held] = field(default_factory=dict)
    """What each granted key's run holds: its slots, and those only a token of."""
    shed: dict[tuple[str, str], list[str]] = field(default_factory=dict)
    """Keys a lossy limit refused, by what becomes of them and the slot that refused them
    (``store.overflow``)."""

    def run_id(self, key: str) -> str:
        return store.run_id_for(self.id, key)


class LimitedClaims:
    """The worker's claims of limited keys, batch by batch beside its main loop."""

    def __init__(
        self,
        driver: AsyncDriver,
        calls: ClaimCalls,
        clock: Clock,
        *,
        gate: LimitGate,
        releases: SlotReleases,
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
        self.releases = releases
        """Where the slots of ended runs go back, a lock's kept for a key of this worker."""
        self.sink = sink
        self.inflight = inflight
        self.runs = runs
        """Where a slot of a run not claimed is given back (``RunStarter.give_back``)."""
        self.refusals = LimitRefusals(driver, gate, sink, runs)
        """What becomes of a key a limit refused: it waits for its slot, or is shed."""
        self.starter = Starter(runs, sink, stats)
        """Where the runs claimed start: the claimer's one place (``Starter``)."""
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
        (``store_slots.take``), then the keys whose slots were all granted claimed together and
        started. A key a limit holds back waits for its slot (``LimitGate.block``)."""
        known = {k: m for k in keys if (m := self.sink.known(k)) is not None}
        heads = await self._heads(keys, known, now)
        if heads is None:
            return
        batch = self._plan(keys, known, heads)
        # a lock slot of this worker's ended run goes straight to the run that waited for it
        claims = [(key, [self.releases.hand_over(r) for r in rs]) for key, rs in batch.plan.claims]
        with self.inflight.claiming([key for key, _ in claims]):
            await self._take_and_claim(claims, names, batch)
        await self._settle(batch)

    async def _heads(
        self, keys: list[str], known: dict[str, Any], now: dt.datetime
    ) -> dict[tuple[str, str], dict[str, Any]] | None:
        """The heads of the batch's sequences (``None``: MongoDB failed; the keys are tried
        again shortly)."""
        pairs = limited.sequences(keys, known, self.gate.limited)
        if not pairs:
            return {}
        # a sequence made of a limit with slots, while their runs may go on (limits.SLOT_RUNS)
        slotted = [p for p in pairs if limits.slot_runs(self.gate.limited.get(p[0]) or {})]
        read = store.heads_and_slots(pairs, slotted, now) if slotted else store.heads(pairs)
        try:
            heads: dict[tuple[str, str], dict[str, Any]] = await self.driver.run(read)
            return heads
        except StorageError as exc:
            log.warning("cannot read the sequences' next tasks, retrying shortly: %s", exc)
            for key in keys:
                self.sink.requeue_at(key, now + RETRY_SOON)
            return None

    def _plan(
        self, keys: list[str], known: dict[str, Any], heads: dict[tuple[str, str], dict[str, Any]]
    ) -> _Batch:
        """The batch: its id, its time and its plan. Its leases and slots end at its time +
        their timeouts: the time is read after ``sent`` (and after the waits before: for a
        batch's turn, for the heads), so none ends before ``sent`` + its timeout by this
        process's clock, when a run's local deadline falls."""
        batch_id = uuid.uuid4().hex
        sent = time.monotonic()
        now = self.clock.now()
        plan = limited.plan(
            keys,
            known,
            self.gate.limited,
            heads,
            now,
            lambda key: store.run_id_for(batch_id, key),
            DEFAULT_SLOT_LEASE_MS,
            self.gate.uses,
            self.gate.units,
        )
        hints = {
            first: t
            for h in heads.values()
            if isinstance(first := h.get("_id"), str)
            and in_range(t := h.get("worker_timeout_ms"), WORKER_TIMEOUT_MS)
        }
        return _Batch(batch_id, sent, now, plan, hints, waits=list(plan.waits))

    async def _take_and_claim(self, claims: Claims, names: list[str], batch: _Batch) -> None:
        """Take the batch's slots, then claim and start the keys granted all of theirs."""
        requests = [r for _, rs in claims for r in rs]
        taken = await self.gate.take(requests, batch.now) if requests else []
        if taken is None:
            batch.requeue += [key for key, _ in claims]
            for r in requests:  # taken or not: given back (a release of nothing is none)
                if r.replaces is not None:
                    self.releases.refused(r.replaces)
                for run_id in filter(None, (r.run_id, r.replaces)):
                    self.runs.give_back(r.slot, run_id)
            return
        granted = self._granted(claims, taken, batch)
        if granted:
            docs = await self._claim_granted(granted, names, batch)
            self.starter.start(docs, batch.sent, batch.held)

    async def _settle(self, batch: _Batch) -> None:
        """Once its keys are no longer being claimed: those held back wait for their slots,
        those MongoDB failed are tried again shortly, those missed or gone are read again."""
        for wait in batch.waits:
            self.gate.block(wait.slot, wait.key, wait.until, batch.now)
        for key in batch.requeue:
            self.sink.requeue_at(key, batch.now + RETRY_SOON)
        for (how, slot), keys in batch.shed.items():
            await self.refusals.shed(keys, how, slot, batch.now)
        if batch.plan.gone or batch.missed:
            await self.sink.requeue([*batch.plan.gone, *batch.missed], later_than=batch.now)
        if batch.plan.unknown:  # forgotten on the way (a switch to the relay's hand-outs)
            await self.sink.requeue(batch.plan.unknown)

    def _granted(self, claims: Claims, taken: list[slots.Taken], batch: _Batch) -> list[str]:
        """The keys whose slots were all granted (what each holds noted in ``batch.held``);
        the others give back what they got and wait for the slot that refused them."""
        results = iter(taken)
        go: list[str] = []
        for key, requests in claims:
            got = [(r, next(results)) for r in requests]
            for request, t in got:
                if request.replaces is not None and not t.taken:  # still the ended run's
                    self.releases.refused(request.replaces)  # given back, not kept again
                    self.runs.give_back(request.slot, request.replaces)
            if all(t.taken for _, t in got):
                go.append(key)
                slots_held = tuple(r.slot for r, t in got if t.limited)
                tokens = frozenset(r.slot for r, t in got if t.limited and not t.holder)
                batch.held[key] = (slots_held, tokens)
            else:
                self.refusals.refused(key, got, batch.now, batch.waits, batch.shed)
        return go

    async def _claim_granted(
        self, keys: list[str], names: list[str], batch: _Batch
    ) -> list[dict[str, Any]]:
        """Claim ``keys`` (their slots taken for this batch's run ids): a sequence's head with
        its group's lock (``plan.locked``); one whose group's lock is held waits for it, one
        MongoDB failed to claim is tried again shortly. The slots of keys not claimed are given
        back. Returns the documents claimed, in the batch's order."""
        self.stats.claim_calls += 1
        self.stats.claim_attempts += len(keys)
        hints = {**batch.hints, **self.sink.timeouts(keys)}  # a head may be unknown here
        locked = batch.plan.locked
        plain = [k for k in keys if k not in locked]
        heads = [k for k in keys if k in locked]
        docs = await self._claim_plain(plain, names, batch, hints)
        got, busy = await self._claim_heads(heads, names, batch)
        docs += got
        claimed = {d["_id"] for d in docs}
        for key in keys:
            if key not in claimed:
                for slot in batch.held.get(key, ((), frozenset()))[0]:
                    self.runs.give_back(slot, batch.run_id(key))
        for doc in docs:
            key = doc["_id"]
            self.gate.held.unblock([key])
            if (lock := locked.get(key)) is not None:
                slots_held, tokens = batch.held.get(key, ((), frozenset()))
                batch.held[key] = ((*slots_held, lock), tokens)
        gone = claimed | busy | set(batch.requeue)
        batch.missed += [k for k in keys if k not in gone]
        return docs

    async def _claim_plain(
        self, keys: list[str], names: list[str], batch: _Batch, hints: dict[str, int]
    ) -> list[dict[str, Any]]:
        """The granted keys claimed without a group's lock, in one call."""
        if not keys:
            return []
        got = await self.calls.send(
            keys, names, batch.now, hints, isolate_on_error=False, batch=batch.id
        )
        if got is None:
            batch.requeue += keys
        return got or []

    async def _claim_heads(
        self, keys: list[str], names: list[str], batch: _Batch
    ) -> tuple[list[dict[str, Any]], set[str]]:
        """Sequences' heads claimed with their groups' locks: the documents claimed, and the
        keys whose group's lock another task holds (busy: each waits for that lock)."""
        if not keys:
            return [], set()
        pairs = {k: limits.lock_group(batch.plan.locked[k]) for k in keys}
        locked = await self.calls.send_locked(pairs, names, batch.now, batch.id)
        if locked is None:
            batch.requeue += keys
            return [], set()
        docs, busy = locked
        batch.waits += [limited.Wait(k, batch.plan.locked[k]) for k in busy]
        return docs, busy
