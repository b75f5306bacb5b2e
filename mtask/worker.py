"""The worker: claims tasks, runs their handlers, records outcomes.

Lifecycle ``ready → running → stopping → stopped``. The main loop waits on ``wake | timer |
stop``; it claims only for free slots, in one round trip per batch. Side tasks — the change
stream, the sweep, the heartbeat, the outcome writer and a loop ticker — are supervised: if one
dies, the worker stops at once and ``run()`` raises, instead of living on half-alive. Leases are
pinged from a thread (``mtask.lease``).

Stopping has two steps: ``stop()`` stops claiming and lets runs in flight finish within
``grace`` seconds; then (or at once with ``stop(immediate=True)``) the rest are cancelled and
their runs marked RELEASED, so another worker takes them at once without spending a retry.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Literal

from pymongo import AsyncMongoClient, MongoClient
from pymongo.errors import PyMongoError

import mtask
from mtask import control, driver, metrics, store
from mtask.client import AsyncTaskClient
from mtask.clock import Clock, ServerClock
from mtask.connection import async_client, sync_client
from mtask.errors import InvalidTask, MtaskError, StorageError
from mtask.gate import LimitGate
from mtask.heap import ClaimQueue
from mtask.lease import LeasePinger
from mtask.recorder import OutcomeRecorder, flow_sweep
from mtask.registry import Registry, TaskContext
from mtask.runs import (
    ActiveRun,
    RunOutcomes,
    WorkerStats,
    default_worker_id,
    dt_seconds,
)
from mtask.schedules import Scheduler
from mtask.store import Outcome, RunState
from mtask.tracing import span
from mtask.watcher import Watcher

log = logging.getLogger("mtask.worker")

WorkerState = Literal["ready", "running", "stopping", "stopped"]
DEFAULT_MAX_RESULT_BYTES = 1024 * 1024
TRACEBACK_LIMIT = 4000


class WorkerCrashed(MtaskError):
    """A part of the worker failed in a way it cannot recover from; the worker stopped."""

    default_message = "a part of the worker died; the worker stopped"


class Worker:
    def __init__(
        self,
        registry: Registry,
        *,
        uri: str | None = None,
        database: str = "mtask",
        collection: str = "tasks",
        worker_id: str | None = None,
        concurrency: int = 10,
        names: Sequence[str] | None = None,
        grace: float = 30.0,
        sweep_interval: float = 30.0,
        flow_sweep_interval: float = 5.0,
        run_schedules: bool = True,
        startup_timeout: float = 60.0,
        heartbeat_interval: float = 2.0,
        stagger_ms: float = 25.0,
        queue_size: int = 10_000,
        max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES,
        clock: Clock | None = None,
        on_event: Callable[..., None] | None = None,
    ) -> None:
        if concurrency < 1:
            raise InvalidTask("must be at least 1", field="concurrency")
        if grace < 0:
            raise InvalidTask("must not be negative", field="grace")
        chosen = list(names) if names else registry.names
        unknown = [n for n in chosen if n not in registry]
        if unknown:
            raise InvalidTask(f"no handler registered for {', '.join(unknown)}", field="names")
        if not chosen:
            raise InvalidTask("the registry has no handlers", field="registry")
        self.registry = registry
        self.uri = uri
        self.database = database
        self.collection_name = collection
        self.worker_id = worker_id or default_worker_id()
        self.concurrency = concurrency
        self.names = chosen
        self.grace = grace
        self.heartbeat_interval = heartbeat_interval
        self.max_result_bytes = max_result_bytes
        self.state: WorkerState = "ready"
        self.stats = WorkerStats()
        self.paused: set[str] = set()
        self.queue = ClaimQueue(queue_size)
        self.clock: Clock = clock or ServerClock()
        # A ServerClock (ours or an injected one) is calibrated here; other clocks are trusted.
        self._server_clock = self.clock if isinstance(self.clock, ServerClock) else None
        self._on_event = on_event
        self._runs: dict[str, ActiveRun] = {}
        self._keys: dict[str, int] = {}  # key -> runs of it in flight here
        self._claiming: set[str] = set()  # keys whose claim is on its way
        self._wake = asyncio.Event()
        self._stop_now = asyncio.Event()
        self._controls_changed = asyncio.Event()
        self._side: list[asyncio.Task[None]] = []
        self._crash: BaseException | None = None
        self._loop_tick = time.monotonic()
        self._sweep_interval = sweep_interval
        self._flow_sweep_interval = flow_sweep_interval
        self.run_schedules = run_schedules
        self._startup_timeout = startup_timeout
        self._stagger_ms = stagger_ms
        self.watcher: Watcher | None = None
        self.pinger: LeasePinger | None = None
        self._peers: dict[str, list[str]] = {}

    # -- public ---------------------------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        return len(self._runs)

    def stop(self, immediate: bool = False) -> None:
        """Stop claiming and drain within ``grace``; ``immediate`` cancels and releases now."""
        if self.state in ("ready", "running"):
            self.state = "stopping"
            self._emit("stopping", immediate=immediate)
        if immediate:
            self._stop_now.set()
        self._wake.set()

    async def run(self) -> None:
        """Run until stopped. Raises ``WorkerCrashed`` if a part of the worker died."""
        if self.state != "ready":
            raise MtaskError(f"a worker runs once; this one is {self.state}")
        self.state = "running"
        loop = asyncio.get_running_loop()
        self._aclient: AsyncMongoClient[dict[str, Any]] = async_client(self.uri)
        self._sclient: MongoClient[dict[str, Any]] = sync_client(self.uri)
        adb, sdb = self._aclient[self.database], self._sclient[self.database]
        self.driver = driver.AsyncDriver(driver.collections(adb, self.collection_name))
        self.gate = LimitGate(self.driver, self.worker_id, self.clock, self._requeue_at)
        self.recorder = OutcomeRecorder(
            self.driver, self.clock, self.gate, self._requeue, self._recorded
        )
        self.scheduler = Scheduler(self.driver, self.clock, list(self.registry.schedules.values()))
        self._publisher = AsyncTaskClient(
            database=self.database,
            collection=self.collection_name,
            clock=self.clock,
            mongo_client=self._aclient,
        )
        self.outcomes = RunOutcomes(
            self.stats, self._emit, self.max_result_bytes, self._publisher.max_params_bytes
        )
        try:
            await self._startup(adb)
            self.pinger = LeasePinger(
                driver.SyncDriver(driver.collections(sdb, self.collection_name)),
                self.worker_id,
                self.clock,
                on_lost=lambda run_id, doc: self._lost_threadsafe(loop, run_id, doc),
                loop_heartbeat=lambda: self._loop_tick,
            )
            self.pinger.start()
            self._start_side_tasks()
            self._emit("started", names=self.names, concurrency=self.concurrency)
            await self._main_loop()
            await self._drain()
        finally:
            await self._shutdown()
        if self._crash is not None:
            raise WorkerCrashed(
                f"worker stopped because a part of it died: {self._crash!r}"
            ) from self._crash

    # -- startup and side tasks -----------------------------------------------------------------

    async def _startup(self, adb: Any) -> None:
        """Reach MongoDB, retrying transient errors for up to ``startup_timeout`` seconds."""
        backoff = 0.5
        deadline = asyncio.get_running_loop().time() + self._startup_timeout
        while True:
            try:
                if self._server_clock is not None:
                    await self._server_clock.calibrate_async(adb)
                await self.driver.run(store.ensure_indexes())
                await self._heartbeat_once()
                await self.gate.refresh()
                return
            except (StorageError, PyMongoError) as exc:
                error = exc if isinstance(exc, StorageError) else driver.storage_error(exc)
                if self.state != "running" or not error.transient:
                    raise error from exc
                if asyncio.get_running_loop().time() + backoff > deadline:
                    raise StorageError(
                        f"gave up after {self._startup_timeout:g}s: {error}", transient=True
                    ) from exc
                log.warning("cannot reach MongoDB yet, retrying in %.1fs: %s", backoff, error)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 10)

    def _start_side_tasks(self) -> None:
        self.watcher = Watcher(
            self.driver,
            worker_id=self.worker_id,
            queue=self.queue,
            clock=self.clock,
            wake=self._wake.set,
            in_flight=self._key_in_flight,
            on_control=self._controls_changed.set,
            on_limit=self.gate.on_change,
            on_schedule=self.scheduler.wake.set,
            sweep_interval=self._sweep_interval,
            stagger_ms=self._stagger_ms,
        )
        self.watcher.names = self._active_names()
        self.watcher.peers = self._peers
        for name, coro in (
            ("stream", self.watcher.run_stream()),
            ("sweep", self.watcher.run_sweep()),
            ("heartbeat", self._heartbeat_loop()),
            ("outcomes", self.recorder.run()),
            ("ticker", self._ticker()),
            ("limits", self.gate.run_refresh()),
            ("flows", flow_sweep(self.driver, self.clock, self._flow_sweep_interval)),
            *([("schedules", self.scheduler.run())] if self.run_schedules else []),
        ):
            task = asyncio.create_task(coro, name=f"mtask-{name}")
            task.add_done_callback(self._side_done)
            self._side.append(task)

    def _side_done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() or self._crash is not None:
            return
        exc = task.exception()
        self._crash = exc or RuntimeError(f"{task.get_name()} ended unexpectedly")
        log.error("%s died: %r; stopping the worker", task.get_name(), self._crash)
        self.stop(immediate=True)

    async def _ticker(self) -> None:
        while True:
            self._loop_tick = time.monotonic()
            await asyncio.sleep(0.2)

    # -- heartbeat, pause, remote stop ---------------------------------------------------------

    async def _heartbeat_once(self) -> None:
        now = self.clock.now()
        doc = await self.driver.run(
            control.heartbeat(
                {
                    "_id": self.worker_id,
                    "host": socket.gethostname(),
                    "pid": os.getpid(),
                    "version": mtask.__version__,
                    "names": self.names,
                    "concurrency": self.concurrency,
                    "in_flight": len(self._runs),
                    "state": self.state,
                    "running": [
                        {"key": r.key, "run_id": r.run_id} for r in list(self._runs.values())[:50]
                    ],
                },
                now,
            )
        )
        if doc.get("stop_requested") and self.state == "running":
            log.info("stop requested remotely")
            self.stop()
        paused = await self.driver.run(control.paused_names())
        if paused != self.paused:
            resumed = bool(self.paused - paused)
            self.paused = paused
            self._emit("paused_changed", paused=sorted(paused))
            if self.watcher is not None:
                self.watcher.names = self._active_names()
                if resumed:
                    self.watcher.request_rescan()
        peers = await self.driver.run(
            control.live_workers(now, 3 * dt_seconds(self.heartbeat_interval))
        )
        table: dict[str, list[str]] = {}
        for peer in peers:
            for name in peer.get("names") or ():
                table.setdefault(name, []).append(peer["_id"])
        self._peers = table
        if self.watcher is not None:
            self.watcher.peers = table

    async def _heartbeat_loop(self) -> None:
        beats = 0
        while True:
            # A change to the controls (pause/resume) beats at once instead of waiting.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._controls_changed.wait(), self.heartbeat_interval)
            self._controls_changed.clear()
            try:
                beats += 1
                if self._server_clock is not None and beats % 15 == 0:
                    await self._server_clock.calibrate_async(self._aclient[self.database])
                await self._heartbeat_once()
            except (StorageError, PyMongoError) as exc:
                log.warning("heartbeat failed, retrying: %s", exc)

    def _active_names(self) -> list[str]:
        return [n for n in self.names if n not in self.paused]

    def _key_in_flight(self, key: str) -> bool:
        return key in self._keys or key in self._claiming

    # -- the main loop --------------------------------------------------------------------------

    async def _main_loop(self) -> None:
        while self.state == "running":
            self._wake.clear()
            timeout: float | None = None
            free = self.concurrency - len(self._runs)
            # Backpressure: claim only while fewer than `concurrency` outcomes wait to be
            # written, so a worker holds at most 2 x concurrency leases (running handlers plus
            # finished runs whose outcome is on its way).
            unwritten = self.recorder.unwritten
            names = self._active_names()
            if free > 0 and names and unwritten <= self.concurrency:
                now = self.clock.now()
                keys = self.queue.pop_due(now, free)
                if keys:
                    await self._claim(keys, names, now)
                    continue
                if self.queue.needs_refill(now) and self.watcher:
                    self.watcher.request_rescan()
                wake_at = min(
                    (t for t in (self.queue.next_due(now), self.queue.overflow_at) if t),
                    default=None,
                )
                if wake_at is not None:
                    timeout = max(0.0, (wake_at - now).total_seconds())
            # asyncio.timeout waits on the event itself; wait_for would wrap it in a task,
            # costing two more event-loop turns between a wake-up and the claim (W2 latency)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._wake.wait()

    async def _claim(self, keys: list[str], names: list[str], now: dt.datetime) -> None:
        if self.gate.limited:
            # Names with a cluster-wide limit are claimed one key at a time, each after its
            # slot and token were taken; the batch claim below never matches them.
            meta = self.watcher.meta if self.watcher else {}
            limited = [k for k in keys if k in meta and self.gate.is_limited(meta[k][0])]
            if limited:
                await self._claim_limited([(k, meta[k][0]) for k in limited], now)
                keys = [k for k in keys if k not in set(limited)]
            names = [n for n in names if not self.gate.is_limited(n)]
            if not keys:
                return
            if not names:  # keys whose name we no longer know: look them up again
                await self._requeue(keys)
                return
        self.stats.claim_calls += 1
        self.stats.claim_attempts += len(keys)
        # From here the keys count as in flight: the claim's own change events may arrive
        # before its reply, and must not put the keys back in the queue.
        self._claiming.update(keys)
        batch = uuid.uuid4().hex
        hints = self.watcher.timeouts(keys) if self.watcher else {}
        sent = time.monotonic()  # no lease of this claim can end before sent + its timeout
        try:
            with span("mtask.claim", keys=len(keys)):
                docs = await self.driver.run(
                    store.claim(
                        keys, names, self.worker_id, now, hints, store.CLAIMED_FIELDS, batch
                    )
                )
            metrics.CLAIM_LATENCY.observe(time.monotonic() - sent)
        except StorageError as exc:
            log.warning("claim failed, retrying shortly: %s", exc)
            docs = await self._adopt(keys, batch)
            if exc.document:  # one document the server cannot update: find it, mark it invalid
                adopted = {d["_id"] for d in docs}
                rest = [k for k in keys if k not in adopted]
                docs += await self._isolate(rest, names, now)
            elif not docs:
                self._claiming.difference_update(keys)
                for key in keys:
                    self.queue.push(key, now + dt_seconds(1))
                await asyncio.sleep(0.5)
                return
        for doc in docs:
            self._start(doc, sent)
        self._claiming.difference_update(keys)
        self.stats.claimed += len(docs)
        claimed = {d["_id"] for d in docs}
        missed = [k for k in keys if k not in claimed]
        if missed:
            # A key we did not get goes back only if it was not yet due when we tried (our
            # clock may be a millisecond early); otherwise another worker has it, or we may not
            # run it, and an event or the sweep brings it back when that changes.
            await self._requeue(missed, later_than=now)

    async def _claim_limited(self, keys: list[tuple[str, str]], now: dt.datetime) -> None:
        """Claim each key after taking a slot (and a token) of its name's limit; once a name
        is full, its other keys wait for a slot to free or a token to come."""
        full: dict[str, dt.datetime] = {}
        hints = self.watcher.timeouts([k for k, _ in keys]) if self.watcher else {}
        for key, name in keys:
            if name in full:
                self.gate.block(name, key, full[name])
                continue
            batch = uuid.uuid4().hex
            run_id = store.run_id_for(batch, key)
            self._claiming.add(key)
            sent = time.monotonic()
            try:
                got = await self.gate.take(name, run_id, key, now, hints.get(key))
                if got is None:
                    self._requeue_at(key, now + dt_seconds(1))
                    continue
                if not got.taken and got.limited:
                    full[name] = got.retry_at or now + dt_seconds(1)
                    self.gate.block(name, key, full[name])
                    continue
                slot = name if got.taken else None
                self.stats.claim_calls += 1
                self.stats.claim_attempts += 1
                try:
                    docs = await self.driver.run(
                        store.claim(
                            [key], [name], self.worker_id, now, hints, store.CLAIMED_FIELDS, batch
                        )
                    )
                except StorageError as exc:
                    log.warning("claim failed, retrying shortly: %s", exc)
                    docs = await self._adopt([key], batch)
                    if not docs:
                        self._requeue_at(key, now + dt_seconds(1))
                for doc in docs:
                    self._start(doc, sent, slot)
                    self.stats.claimed += 1
                if not docs:
                    if slot is not None:
                        self.recorder.release_slot(slot, run_id)
                    self._claiming.discard(key)
                    await self._requeue([key], later_than=now)  # as for a batch claim's misses
            finally:
                self._claiming.discard(key)

    def _requeue_at(self, key: str, when: dt.datetime) -> None:
        """Back in the queue at ``when``: a key held back by a limit, or whose slot could not
        be taken. It is no longer being claimed (else the watcher would not queue it)."""
        self._claiming.discard(key)
        if self.watcher is not None:
            self.watcher.requeue_at(key, when)

    async def _isolate(
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
                await self._mark_invalid(key, f"a claim cannot update the document: {exc}")
        return claimed

    async def _mark_invalid(self, key: str, reason: str) -> None:
        try:
            await self.driver.run(store.quarantine([key], self.clock.now(), reason))
            log.warning("marked task %r invalid: %s", key, reason)
        except StorageError as exc:
            if not exc.document:  # MongoDB in trouble: a later claim tries again
                log.warning("cannot mark task %r invalid now (%s): %s", key, reason, exc)
                return
            log.warning(
                "ignoring task %r from now on: %s (cannot mark it invalid: %s)", key, reason, exc
            )
            if self.watcher is not None:
                self.watcher.ignored.add(key)

    async def _adopt(self, keys: list[str], batch: str) -> list[dict[str, Any]]:
        """After a failed claim call: the write may have been applied although its reply was
        lost (multi-document writes are not retried by the driver). Find and run what this
        batch claimed, rather than leave it to time out."""
        for attempt in range(5):
            try:
                return await self.driver.run(store.read_claimed(keys, batch, store.CLAIMED_FIELDS))
            except StorageError:
                await asyncio.sleep(0.2 * 2**attempt)
        log.warning("could not check what a failed claim took; its leases will run out")
        return []

    async def _requeue(self, keys: list[str], later_than: dt.datetime | None = None) -> None:
        """Put tasks back in the claim queue from their current documents (for when no change
        event will: a claim that missed, an outcome that could not be written). With
        ``later_than``, only those not claimable by then."""
        try:
            docs = await self.driver.run(store.placements(keys))
        except StorageError as exc:  # the sweep brings them back
            log.warning("cannot re-read tasks to requeue them: %s", exc)
            return
        for doc in docs:
            claim_at = doc.get("next_claim_at")
            due_already = later_than is not None and not (
                isinstance(claim_at, dt.datetime) and claim_at > later_than
            )
            malformed = doc.get("well_formed") is False  # the watcher marks it invalid
            if self.watcher is not None and (malformed or not due_already):
                self.watcher.place_safely(doc)

    # -- running a handler ----------------------------------------------------------------------

    def _start(self, doc: dict[str, Any], sent: float, slot: str | None = None) -> None:
        run_id = doc["claim_run_id"]
        options = doc["options"]
        ctx = TaskContext(
            key=doc["_id"],
            name=doc["name"],
            attempt=doc["attempts"],
            run_id=run_id,
            worker_id=self.worker_id,
            publisher=self._publisher.publish,
        )
        run = ActiveRun(
            key=doc["_id"],
            name=doc["name"],
            run_id=run_id,
            ctx=ctx,
            slot=slot,
            has_dependents=doc.get("has_dependents") is True,
        )
        self._runs[run_id] = run
        self._keys[run.key] = self._keys.get(run.key, 0) + 1
        self.queue.discard(run.key)
        assert self.pinger is not None
        self.pinger.add(
            run.key,
            run_id,
            options["ping_interval_ms"],
            options["worker_timeout_ms"],
            sent,
            slot=slot,
        )
        run.task = asyncio.create_task(self._execute(run, doc), name=f"mtask-run-{run.key}")
        self._watch_deadline(run)
        metrics.by_name(metrics.CLAIMED, run.name).inc()
        metrics.IN_FLIGHT.inc()
        self._emit("claimed", key=run.key, run_id=run_id, attempt=ctx.attempt)

    async def _execute(self, run: ActiveRun, doc: dict[str, Any]) -> None:
        outcome: Outcome | None
        try:
            outcome = await self.outcomes.call(run, self.registry[run.name], doc)
        except asyncio.CancelledError:
            outcome = self.outcomes.stopped(run)
            if outcome is None and run.stop_reason is None:
                raise
        finally:
            metrics.IN_FLIGHT.dec()
            metrics.by_name(metrics.RUN_DURATION, run.name).observe(time.monotonic() - run.started)
            if run.deadline is not None:
                run.deadline.cancel()
            self._runs.pop(run.run_id, None)
            left = self._keys.pop(run.key, 1) - 1
            if left:
                self._keys[run.key] = left
            if self.pinger is not None:
                self.pinger.remove(run.run_id)
            if run.slot is not None:  # given back by the outcome writer, after the outcome
                self.recorder.release_slot(run.slot, run.run_id)
            self._wake.set()
        if outcome is not None:
            self.recorder.add(outcome)

    def _watch_deadline(self, run: ActiveRun) -> None:
        """Stop a run when its lease has run out by this process's own clock, before any
        other worker can take it over: after a freeze (SIGSTOP, a VM pause) the run is stopped
        by the first timer that fires, not by a ping answered later, and no ping success is
        assumed while MongoDB cannot be reached."""
        expiry = self.pinger.expiry(run.run_id) if self.pinger is not None else None
        if expiry is None or run.task is None or run.task.done() or run.stop_reason:
            return
        loop = asyncio.get_running_loop()
        if loop.time() < expiry:
            run.deadline = loop.call_at(expiry, self._watch_deadline, run)
            return
        assert self.pinger is not None
        self.pinger.remove(run.run_id)
        log.warning(
            "the lease of %s run %s ran out before a ping could extend it (was the process "
            "frozen, or MongoDB out of reach?)",
            run.key,
            run.run_id[:8],
        )
        self._lost(run.run_id, None)

    def _lost_threadsafe(
        self, loop: asyncio.AbstractEventLoop, run_id: str, doc: dict[str, Any] | None
    ) -> None:
        loop.call_soon_threadsafe(self._lost, run_id, doc)

    def _lost(self, run_id: str, doc: dict[str, Any] | None) -> None:
        """The pinger found that a run no longer owns its task: stop its handler."""
        run = self._runs.get(run_id)
        if run is None or run.task is None or run.stop_reason is not None:
            return  # gone, or already being stopped (the local deadline and a ping may race)
        still_running = doc is not None and any(
            r.get("run_id") == run_id and r.get("state") == "RUNNING" for r in doc.get("runs", ())
        )
        if doc is not None and doc.get("status") == "cancelled":
            run.stop_reason = "cancelled"
        elif still_running:
            run.stop_reason = "not_allowed"  # specific_worker_ids no longer names us
        else:
            run.stop_reason = "lost"
            self.stats.lease_lost += 1
            metrics.by_name(metrics.LEASE_LOST, run.name).inc()
            log.warning(
                "lease lost: %s run %s was taken over; its outcome will not be recorded",
                run.key,
                run_id[:8],
            )
        self._emit("stopping_run", key=run.key, run_id=run_id, reason=run.stop_reason)
        run.ctx.cancelled.set()
        run.task.cancel()

    # -- outcomes -------------------------------------------------------------------------------

    def _recorded(self, outcomes: list[Outcome], recorded: int) -> None:
        if recorded < len(outcomes):
            log.info(
                "%d of %d outcome(s) were fenced out (their runs lost the task)",
                len(outcomes) - recorded,
                len(outcomes),
            )
        all_landed = recorded == len(outcomes)  # else some may have been requeued
        for outcome in outcomes:
            if (
                all_landed
                and outcome.state is RunState.SUCCESS
                and self.watcher is not None
                and not self._key_in_flight(outcome.key)
            ):
                self.watcher.succeeded(outcome.key)  # its stream skips the event
            self._emit(
                "recorded", key=outcome.key, run_id=outcome.run_id, state=outcome.state.value
            )
        self._wake.set()  # their slots are free now

    # -- stopping -------------------------------------------------------------------------------

    async def _drain(self) -> None:
        """Step one of stopping: wait up to ``grace`` (or until an immediate stop) for the runs
        in flight; step two: cancel what is left and release it."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.grace
        stop_now = asyncio.create_task(self._stop_now.wait())
        try:
            while not stop_now.done():
                pending = [r.task for r in self._runs.values() if r.task and not r.task.done()]
                remaining = deadline - loop.time()
                if not pending or remaining <= 0:
                    break
                log.info("stopping: waiting up to %.1fs for %d run(s)", remaining, len(pending))
                await asyncio.wait(
                    [*pending, stop_now], timeout=remaining, return_when=asyncio.FIRST_COMPLETED
                )
        finally:
            stop_now.cancel()
        for run in list(self._runs.values()):
            if run.task is not None and not run.task.done():
                run.stop_reason = "shutdown"
                run.ctx.cancelled.set()
                run.task.cancel()
        stopping = [r.task for r in self._runs.values() if r.task is not None]
        if stopping:
            await asyncio.gather(*stopping, return_exceptions=True)
        if self._crash is None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.recorder.all_written.wait(), timeout=30)

    async def _shutdown(self) -> None:
        for task in self._side:
            task.cancel()
        await asyncio.gather(*self._side, return_exceptions=True)
        if self.pinger is not None:
            await asyncio.to_thread(self.pinger.stop)
        if self.pinger is not None:  # registered (startup reached MongoDB): deregister
            with contextlib.suppress(StorageError, TimeoutError):
                await asyncio.wait_for(
                    self.driver.run(control.deregister(self.worker_id)), timeout=5
                )
        await self._aclient.close()
        self._sclient.close()
        self.state = "stopped"
        self._emit("stopped", stats=self.stats)

    # -- events ---------------------------------------------------------------------------------

    def _emit(self, event: str, **data: Any) -> None:
        if event in (
            "claimed",
            "succeeded",
            "failed",
            "released",
            "cancelled",
            "stopping_run",
            "started",
            "stopping",
            "stopped",
        ):
            log.info("%s %s", event, " ".join(f"{k}={v}" for k, v in data.items()))
        if self._on_event is not None:
            self._on_event(event, **data)
