"""The claim path (River's producer): which keys to claim, claiming them, and what a claim
that failed or missed leaves to do.

``run`` is the worker's main loop. It waits on ``wake | timer``, and claims only for free
slots, in one round trip per batch (``store.claim``), only while at most ``concurrency``
outcomes wait to be written (so a worker holds at most twice its slots in leases). Keys of
names under a cluster-wide limit are claimed in a batch too, after their slots and tokens
(``claim_limited``: a sequence's next task read, the slots taken in one bulk write). A claim
call that fails is followed by a read of what it may have taken anyway (``adopt``); a batch
refused because of one document's write error is claimed again one key at a time
(``isolate``) and the bad document marked invalid (``mark_invalid``).

Ownership: every field is the event loop's. Keys are ``InFlight.claiming`` from the moment a
claim is sent until its runs have started, so the claim's own change events cannot queue them.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import time
import uuid
from typing import Any, ClassVar

from mtask import limits, metrics, slots, store
from mtask.clock import Clock
from mtask.driver import AsyncDriver
from mtask.errors import StorageError
from mtask.store.transactional import expired_transactions, kill_sessions
from mtask.tracing import span
from mtask.worker import limited
from mtask.worker.claim_queue import ClaimQueue
from mtask.worker.executor import Executor
from mtask.worker.finding.protocols import QueueSink
from mtask.worker.inflight import InFlight
from mtask.worker.limit_gate import DEFAULT_SLOT_LEASE_MS, LimitGate
from mtask.worker.presence import Assignment, Lifecycle
from mtask.worker.recorder import OutcomeRecorder
from mtask.worker.stats import WorkerStats

log = logging.getLogger(__name__)

RETRY_SOON = dt.timedelta(seconds=1)
"""How long a key waits after a claim or a slot could not be had because of MongoDB."""
ADOPT_ATTEMPTS = 5
LIMITED_IN_FLIGHT = 2
"""Batches of limited keys being claimed at once (``Claimer.claim_limited_soon``)."""


class Claimer:
    name: ClassVar[str] = "claimer"

    def __init__(
        self,
        driver: AsyncDriver,
        clock: Clock,
        *,
        worker_id: str,
        concurrency: int,
        queue: ClaimQueue,
        inflight: InFlight,
        assignment: Assignment,
        sink: QueueSink,
        gate: LimitGate,
        recorder: OutcomeRecorder,
        executor: Executor,
        stats: WorkerStats,
        lifecycle: Lifecycle,
        wake: asyncio.Event,
    ) -> None:
        self.driver = driver
        self.clock = clock
        self.worker_id = worker_id
        self.concurrency = concurrency
        self.queue = queue
        self.inflight = inflight
        self.assignment = assignment
        self.sink = sink
        self.gate = gate
        self.recorder = recorder
        self.executor = executor
        self.stats = stats
        self.lifecycle = lifecycle
        self.limited_batches: set[asyncio.Task[None]] = set()
        self.limited_pending = 0
        """Keys in the limited batches on their way (``claim_limited_soon``)."""
        self.failure: BaseException | None = None
        self.wake = wake
        """Set by whoever may have made a claim possible: the finding parts (a task queued), the
        executor and the recorder (a slot freed), ``Worker.stop``."""

    async def run(self) -> None:
        """The main loop: until the worker stops, claim what is due for the free slots."""
        try:
            await self._loop()
        finally:  # the limited batches on their way start their runs, or are cancelled
            if self.limited_batches:
                await asyncio.wait(self.limited_batches)

    async def _loop(self) -> None:
        while self.lifecycle.state == "running":
            self.wake.clear()
            claimed, timeout = await self.run_once()
            if claimed:
                continue
            # asyncio.timeout waits on the event itself; wait_for would wrap it in a task,
            # costing two more event-loop turns between a wake-up and the claim (W2 latency)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self.wake.wait()

    def capacity(self) -> int:
        """How many more tasks this worker can take now (``--stream shared``: its credit):
        its slots less its runs, its claims on their way, the outcomes not yet written and the
        due keys in its queue. (A written success gives its slot back to the relay by its
        event, and the relay counts it: ``finding.shared.credit``.)"""
        if self.lifecycle.state != "running":
            return 0
        busy = self.inflight.load + self.recorder.unwritten + self.queue.due(self.clock.now())
        return self.concurrency - busy

    async def run_once(self) -> tuple[bool, float | None]:
        """Claim once if a slot is free and a key due. Returns whether it claimed, and how
        long to sleep at most until the next key is due (``None``: until woken). The lock
        slots kept for a handover before this pass and not used in it are given back."""
        started = time.monotonic()
        try:
            return await self._pass()
        finally:
            kept = self.gate.unused(started if not self.limited_batches else float("-inf"))
            for slot, run_ids in kept.items():
                for run_id in run_ids:
                    self.recorder.release_slot(slot, run_id)

    async def _pass(self) -> tuple[bool, float | None]:
        if self.failure is not None:
            raise self.failure
        free = self.concurrency - len(self.inflight) - self.limited_pending
        names = self.assignment.active
        # Backpressure: claim only while fewer than `concurrency` outcomes wait to be
        # written, so a worker holds at most 2 x concurrency leases (running handlers plus
        # finished runs whose outcome is on its way).
        if free <= 0 or not names or self.recorder.unwritten > self.concurrency:
            return False, None
        now = self.clock.now()
        keys = self.queue.pop_due(now, free)
        if keys:
            await self.claim(keys, names, now)
            return True, None
        if self.queue.needs_refill(now):
            self.sink.request_rescan()
        wake_at = min(
            (t for t in (self.queue.next_due(now), self.queue.overflow_at) if t), default=None
        )
        return False, None if wake_at is None else max(0.0, (wake_at - now).total_seconds())

    async def claim(self, keys: list[str], names: list[str], now: dt.datetime) -> None:
        """Claim ``keys`` (due at ``now``) for ``names``, and start the runs claimed."""
        if self.gate.limited:
            # Names with a cluster-wide limit are claimed after their slots were taken; the
            # batch claim below never matches them.
            held = [k for k in keys if (m := self.sink.known(k)) and self.gate.is_limited(m.name)]
            if held:
                await self.claim_limited_soon(held, names, now)
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
            sent = time.monotonic()  # no lease of this claim can end before sent + its timeout
            with span("mtask.claim", keys=len(keys)):
                docs = await self._send(keys, names, now, hints, isolate_on_error=True)
            if docs is None:  # MongoDB failed and nothing was taken: try again shortly
                for key in keys:
                    self.queue.push(key, now + RETRY_SOON)
            else:
                metrics.CLAIM_LATENCY.observe(time.monotonic() - sent)
                for doc in docs:
                    self.executor.start(doc, sent)
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

    async def _send(
        self,
        keys: list[str],
        names: list[str],
        now: dt.datetime,
        hints: dict[str, int] | None,
        *,
        isolate_on_error: bool,
        batch: str | None = None,
    ) -> list[dict[str, Any]] | None:
        """One claim call, and on a storage error what it took anyway (``adopt``), plus, for
        one document's write error, the rest claimed one by one (``isolate``). ``None``: the
        call failed and nothing was taken."""
        batch = batch or uuid.uuid4().hex
        try:
            return await self.driver.run(
                store.claim(keys, names, self.worker_id, now, hints, store.CLAIMED_FIELDS, batch)
            )
        except StorageError as exc:
            log.warning(
                "claim failed, retrying shortly: %s", exc, extra={"keys": len(keys), "batch": batch}
            )
            docs = await self.adopt(keys, batch)
            if exc.timed_out:
                await self.kill_stale_transactions(keys)
            if exc.document and isolate_on_error:
                adopted = {d["_id"] for d in docs}
                return docs + await self.isolate([k for k in keys if k not in adopted], names, now)
            return docs or None

    async def claim_limited_soon(self, keys: list[str], names: list[str], now: dt.datetime) -> None:
        """``claim_limited`` in the background, at most ``LIMITED_IN_FLIGHT`` batches at once:
        a batch of limited keys costs more round trips than a plain one (the heads, the slots),
        and the next batch need not wait for them. Its keys count as taken meanwhile."""
        while len(self.limited_batches) >= LIMITED_IN_FLIGHT:
            await asyncio.wait(self.limited_batches, return_when=asyncio.FIRST_COMPLETED)
        self.limited_pending += len(keys)

        async def batch() -> None:
            try:
                await self.claim_limited(keys, names, now)
            finally:
                self.limited_pending -= len(keys)
                self.wake.set()

        task = asyncio.create_task(batch(), name="mtask-claim-limited")
        self.limited_batches.add(task)
        task.add_done_callback(self._limited_done)

    def _limited_done(self, task: asyncio.Task[None]) -> None:
        self.limited_batches.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            self.failure = exc  # raised by the main loop: the worker stops, as for its own

    async def claim_limited(self, keys: list[str], names: list[str], now: dt.datetime) -> None:
        """Claim ``keys`` of limited names as one batch: the heads of their sequences read,
        then every slot they need taken in one bulk write (``slots.take``), then the keys
        whose slots were all granted claimed together. A key a limit holds back waits for its
        slot (``LimitGate.block``)."""
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
            sent = time.monotonic()
            requests = [r for _, rs in claims for r in rs]
            taken = await self.gate.take(requests, now) if requests else []
            if taken is None:
                requeue = candidates
                for r in requests:  # taken or not: given back (a release of nothing is none)
                    for run_id in filter(None, (r.run_id, r.replaces)):
                        self.recorder.release_slot(r.slot, run_id)
            else:
                go, held = self._granted(claims, taken, waits)
                hints = {
                    h["_id"]: t
                    for h in heads.values()
                    if isinstance(t := h.get("worker_timeout_ms"), int)
                }
                missed = await self._claim_granted(
                    go, held, plan, names, now, sent, batch, hints, waits, requeue
                )
        for wait in waits:  # no longer claiming: they may be queued again
            self.gate.block(wait.slot, wait.key, wait.until, now)
        for key in requeue:
            self.sink.requeue_at(key, now + RETRY_SOON)
        if plan.gone or missed:
            await self.sink.requeue([*plan.gone, *missed], later_than=now)

    def _granted(
        self,
        claims: list[tuple[str, list[slots.Request]]],
        taken: list[slots.Taken],
        waits: list[limited.Wait],
    ) -> tuple[list[str], dict[str, tuple[str, ...]]]:
        """The keys whose slots were all granted, and the slots each holds; the others give
        back what they got and wait for the slot that refused them."""
        results = iter(taken)
        go: list[str] = []
        held: dict[str, tuple[str, ...]] = {}
        for key, requests in claims:
            got = [(r, next(results)) for r in requests]
            for request, t in got:
                if request.replaces is not None and not t.taken:  # still the ended run's
                    self.recorder.release_slot(request.slot, request.replaces)
            if all(t.taken for _, t in got):
                go.append(key)
                held[key] = tuple(r.slot for r, t in got if t.limited)
                continue
            for request, t in got:
                if t.taken and t.limited:
                    self.recorder.release_slot(request.slot, request.run_id)
            request, refusal = next((r, t) for r, t in got if not t.taken)
            waits.append(limited.Wait(key, request.slot, refusal.retry_at))
        return go, held

    async def _claim_granted(
        self,
        keys: list[str],
        held: dict[str, tuple[str, ...]],
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
            got = await self._send(plain, names, now, hints, isolate_on_error=False, batch=batch)
            docs += got or []
            failed += plain if got is None else []
        busy: set[str] = set()
        if heads:
            pairs = {k: limits.lock_group(plan.locked[k]) for k in heads}
            locked = await self._send_locked(pairs, names, now, batch)
            docs += locked[0] if locked else []
            busy = locked[1] if locked else set()
            failed += heads if locked is None else []
        for doc in docs:
            key = doc["_id"]
            self.gate.unblock([key])
            lock = plan.locked.get(key)
            self.executor.start(doc, sent, held.get(key, ()) + ((lock,) if lock else ()))
            self.sink.claimed(doc)
            self.stats.claimed += 1
        claimed = {d["_id"] for d in docs}
        for key in keys:
            if key not in claimed:
                for slot in held.get(key, ()):
                    self.recorder.release_slot(slot, store.run_id_for(batch, key))
        waits += [limited.Wait(k, plan.locked[k]) for k in busy]  # another task holds it
        requeue += failed
        gone = claimed | busy | set(failed)
        return [k for k in keys if k not in gone]

    async def _send_locked(
        self, groups: dict[str, tuple[str, str]], names: list[str], now: dt.datetime, batch: str
    ) -> tuple[list[dict[str, Any]], set[str]] | None:
        """Claim sequences' heads with their groups' locks (``store.claim_locked``): the
        documents claimed and the keys whose group is busy; ``None`` if MongoDB failed (what
        the call took anyway is adopted). A document the server cannot update is marked
        invalid."""
        try:
            docs, busy, broken = await self.driver.run(
                store.claim_locked(groups, names, self.worker_id, now, store.CLAIMED_FIELDS, batch)
            )
        except StorageError as exc:
            log.warning(
                "claim failed, retrying shortly: %s",
                exc,
                extra={"keys": len(groups), "batch": batch},
            )
            adopted = await self.adopt(list(groups), batch)
            return (adopted, set()) if adopted else None
        for key, reason in broken.items():
            await self.mark_invalid(key, f"a claim cannot update the document: {reason}")
        return docs, busy

    async def isolate(
        self, keys: list[str], names: list[str], now: dt.datetime
    ) -> list[dict[str, Any]]:
        """Claim ``keys`` one at a time after a batch claim failed on one document's write
        error; mark the documents whose own claim fails so ``invalid`` with the error (or,
        when even that cannot be written, ignore them from now on, logged once)."""
        claimed: list[dict[str, Any]] = []
        for key in keys:
            try:
                claimed += await self.driver.run(
                    store.claim(
                        [key],
                        names,
                        self.worker_id,
                        now,
                        None,
                        store.CLAIMED_FIELDS,
                        uuid.uuid4().hex,
                        isolate=True,
                    )
                )
            except StorageError as exc:
                if not exc.document:
                    break  # not this document's fault: the sweep brings the rest back
                await self.mark_invalid(key, f"a claim cannot update the document: {exc}")
        return claimed

    async def mark_invalid(self, key: str, reason: str) -> None:
        try:
            await self.driver.run(store.quarantine([key], self.clock.now(), reason))
            log.warning("marked task %r invalid: %s", key, reason, extra={"key": key})
        except StorageError as exc:
            if not exc.document:  # MongoDB in trouble: a later claim tries again
                log.warning(
                    "cannot mark task %r invalid now (%s): %s", key, reason, exc, extra={"key": key}
                )
                return
            log.warning(
                "ignoring task %r from now on: %s (cannot mark it invalid: %s)",
                key,
                reason,
                exc,
                extra={"key": key},
            )
            self.sink.ignore(key)

    async def kill_stale_transactions(self, keys: list[str]) -> None:
        """After a claim ran out of time: it may have waited for the open transaction of a run
        whose lease has ended (frozen or killed between its fenced SUCCESS and its commit),
        which the server would keep for a minute or more. Kill those transactions: the retried
        claim goes through (docs/transactions.md, "Under faults")."""
        try:
            stale = await self.driver.run(expired_transactions(keys, self.clock.now()))
            if stale:
                await self.driver.run(kill_sessions(stale))
                log.warning(
                    "killed %d open transaction(s) of runs whose lease ended, in the way of a "
                    "claim",
                    len(stale),
                    extra={"keys": len(keys)},
                )
        except StorageError as exc:
            log.warning("cannot check for stale transactions: %s", exc)

    async def adopt(self, keys: list[str], batch: str) -> list[dict[str, Any]]:
        """After a failed claim call: the write may have been applied although its reply was
        lost (multi-document writes are not retried by the driver). Find and run what this
        batch claimed, rather than leave it to time out."""
        for attempt in range(ADOPT_ATTEMPTS):
            try:
                return await self.driver.run(store.read_claimed(keys, batch, store.CLAIMED_FIELDS))
            except StorageError:
                await asyncio.sleep(0.2 * 2**attempt)
        log.warning(
            "could not check what a failed claim took; its leases will run out",
            extra={"batch": batch},
        )
        return []
