"""Pinging leases from a thread of its own.

``LeasePinger`` extends the lease of every run in flight at the task's ``ping_interval_ms``
(at most a third of its ``worker_timeout_ms``: ``ping_every``) with pymongo's sync client, on
a thread, so pings keep flowing while a handler hogs the event loop or holds the GIL for a
while. A ping that matches nothing means the run lost the task;
the pinger reports it (``on_lost``) and forgets the run. A run's limit slots are extended with
its lease; one found taken by another run (``slots.extend``) is reported (``on_slot_lost``),
and the run forgotten too. A run that holds no place in a slot (granted only a token by a
slot limiting only a rate) takes one when the slot comes to limit runs at once: a concurrency
added later counts it, and does not stop it. A changed ping interval applies from the next
ping. A frozen process (SIGSTOP) freezes this thread too, so its leases run out and the runs
are preempted, as they must be. A lease past its local deadline is never pinged again: a ping
sent after it (the thawed thread's first) would extend on the server a lease whose run has
already stopped by its own clock (``mtask.worker.running.deadlines``), and let that run's outcome be
recorded. ``watch`` passes each renewal on as it happens: a process-isolated run's child
follows its lease that way, and stops itself when it runs out unrenewed
(``mtask.worker.running.pool.child``).

Ownership: ``_leases`` is shared between the event loop's thread (``add``, ``remove``,
``expiry``) and the pinger thread; every write holds ``_cond``. ``expiry`` reads one entry
without the lock, which is safe under the GIL (a dict read of one key is atomic) and may see a
value one ping old, which only makes the local deadline earlier. ``LoopTicker.last`` is written
on the loop's thread and read here (a float read is atomic).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from mtask import driver, store
from mtask.clock import Clock
from mtask.errors import StorageError
from mtask.limits.slots import Request
from mtask.store.slots import extend as extend_slot
from mtask.worker.running.lost_runs import LostCallback, LostRuns, SlotLostCallback

log = logging.getLogger("mtask.worker.running.lease")  # the name operators filter on, kept

TICK_SECONDS = 0.2

PING_MAX_TIME_MS = 100
"""The least ``maxTimeMS`` of a ping (otherwise its interval): a ping waiting for a transaction
that holds its task document fails and is retried instead of holding up every other ping."""


def ping_every(ping_interval_ms: float, worker_timeout_ms: float) -> float:
    """Seconds between a run's pings: its ``ping_interval_ms``, but at most a third of its lease
    (``worker_timeout_ms``). A lease that ran out between two pings would stop every run longer
    than it (the default interval, 5 s, under a 3 s timeout); a third lets one ping come late
    and the next still land in time."""
    return min(ping_interval_ms, worker_timeout_ms / 3) / 1000


class LoopTicker:
    """Side service: notes every ``TICK_SECONDS`` that the event loop runs, so the pinger
    thread can tell when a handler blocks the loop."""

    name: ClassVar[str] = "ticker"

    def __init__(self) -> None:
        self.last = time.monotonic()
        """Written on the loop's thread, read on the pinger thread."""

    async def run(self) -> None:
        while True:
            self.last = time.monotonic()
            await asyncio.sleep(TICK_SECONDS)


class LoopWatch:
    """The pinger thread's look at the loop's ticker (``heartbeat``: when it last ticked):
    it logs once when the loop has not ticked for a while."""

    def __init__(self, heartbeat: Callable[[], float] | None) -> None:
        self.heartbeat = heartbeat
        self.logged = False

    def check(self) -> None:
        """Log once when the worker's event loop has not ticked for a while: a handler is
        blocking it (its leases are still pinged from the pinger's thread)."""
        if self.heartbeat is None:
            return
        stalled = time.monotonic() - self.heartbeat()
        if stalled > 2.0 and not self.logged:
            self.logged = True
            log.warning(
                "the event loop has been blocked for %.1fs: a handler is blocking it; "
                "use a plain def handler (run in a thread) for blocking work",
                stalled,
            )
        elif stalled < 1.0:
            self.logged = False


@dataclass
class _Lease:
    key: str
    run_id: str
    interval: float
    timeout: float
    next_at: float
    started: float
    expires: float
    """When the lease runs out at the earliest, by this process's monotonic clock."""
    overdue_logged: bool = False
    slots: tuple[str, ...] = ()
    """The limit slots this run holds (a name's, a group's): extended with each ping."""
    joins: set[str] = field(default_factory=set)
    """Those of ``slots`` where the run holds no place (its take only granted it a token, or the
    slot stopped limiting runs at once): it takes one if the slot limits runs at once now
    (``slots.extend``). Written by the pinger's thread only (and by ``add`` and ``hold``)."""
    paused: bool = False
    """Not pinged: the run's transaction is open (``pause``)."""
    holds: bool = False
    """The run holds a sequence's lock or limit slots: if it is stopped while it still runs
    (its task cancelled, this worker no longer allowed), its lease is kept (``stopping``)
    until it has really stopped, so that they stay held (docs/flow-control.md)."""
    stopping: bool = False
    """Pinged as a run being stopped (``store.extend_lease``'s ``stopping``)."""
    watchers: list[Callable[[float], None]] = field(default_factory=list)
    """Told each new ``expires`` (``watch``), under the pinger's lock."""

    def renewed(self, expires: float) -> None:
        """Note a later expiry and tell the watchers (call with the pinger's lock held)."""
        self.expires = expires
        for watcher in self.watchers:
            watcher(expires)


def extend_slots(
    driver: driver.SyncDriver, worker_id: str, lease: _Lease, server_now: dt.datetime, lease_ms: int
) -> str | None:
    """Extend the run's places in its limit slots (``slots.extend``) with its lease; returns
    the first slot it held a place in and lost, if any (the rest are not pinged: the run
    stops)."""
    for slot in lease.slots:
        request = Request(slot, lease.run_id, lease.key, lease_ms)
        held = driver.run(extend_slot(request, worker_id, server_now, slot in lease.joins))
        if held is False:
            return slot
        if held:
            lease.joins.discard(slot)
        else:  # the slot limits no runs at once: the run holds no place there
            lease.joins.add(slot)
    return None


class LeasePinger:
    """The pinging: each run's lease (and its limit slots) extended on time from a thread of
    its own. What a ping that missed means for its run is ``LostRuns``'s to say."""

    def __init__(
        self,
        driver: driver.SyncDriver,
        worker_id: str,
        clock: Clock,
        on_lost: LostCallback,
        on_slot_lost: SlotLostCallback,
        loop_heartbeat: Callable[[], float] | None = None,
    ) -> None:
        self._driver = driver
        self._worker_id = worker_id
        self._clock = clock
        self._lost = LostRuns(on_lost, on_slot_lost)
        """Told of a run no longer its own: it tells the executor, on its loop."""
        self._loop_watch = LoopWatch(loop_heartbeat)
        self._leases: dict[str, _Lease] = {}
        self._cond = threading.Condition()
        self._stopping = False
        self._wake_at = 0.0
        """When the thread's current wait ends (monotonic); 0 while it is not waiting."""
        self._thread = threading.Thread(target=self._run, name="mtask-pinger", daemon=True)
        self._failing = False
        self.pings = 0

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start the thread; with a ``loop``, ``on_lost`` and ``on_slot_lost`` are called on it,
        not on the thread."""
        self._lost.deliver_on(loop)
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.ident is not None:  # started
            self._thread.join(timeout=10)

    def add(
        self,
        key: str,
        run_id: str,
        ping_interval_ms: int,
        worker_timeout_ms: int,
        claim_sent: float,
        slots: tuple[str, ...] = (),
        tokens: frozenset[str] = frozenset(),
        holds: bool = False,
    ) -> None:
        """Ping a run's lease from now on; ``claim_sent`` is when (monotonic) the claim that
        took it began, before it read the time its lease ends from, so the lease cannot end
        before ``claim_sent + timeout``. ``slots``: its limit slots, extended with it;
        ``tokens``: those it was only granted a token of (``slots.Taken.holder``); ``holds``:
        it holds a sequence's lock or limit slots (``_Lease.holds``)."""
        now = time.monotonic()
        interval = ping_every(ping_interval_ms, worker_timeout_ms)
        timeout = worker_timeout_ms / 1000
        with self._cond:
            self._leases[run_id] = _Lease(
                key,
                run_id,
                interval,
                timeout,
                now + interval,
                now,
                claim_sent + timeout,
                slots=slots,
                joins=set(tokens),
                holds=holds,
            )
            # wake the thread only if this ping is due before it wakes anyway: a woken thread
            # takes the GIL from the event loop, on every claim
            if now + interval < self._wake_at:
                self._cond.notify()

    def expiry(self, run_id: str) -> float | None:
        """When the run's lease runs out at the earliest (monotonic); None if not pinged."""
        lease = self._leases.get(run_id)
        return None if lease is None else lease.expires

    def watch(self, run_id: str, on_expiry: Callable[[float], None]) -> Callable[[], None]:
        """Call ``on_expiry`` with the run's lease expiry (monotonic) now and after every
        renewal, on the pinger's thread, until the returned function is called: how a
        process-isolated run's child learns its deadline (``mtask.worker.running.pool.child``).
        ``on_expiry`` runs under the pinger's lock: it must only note the value. Nothing if
        the run is not pinged."""
        with self._cond:
            lease = self._leases.get(run_id)
            if lease is None:
                return lambda: None
            lease.watchers.append(on_expiry)
            on_expiry(lease.expires)

        def unwatch() -> None:
            with self._cond, contextlib.suppress(ValueError):
                lease.watchers.remove(on_expiry)

        return unwatch

    def pause(self, run_id: str) -> None:
        """Stop pinging the run until ``resume``: its transaction will write the task document
        (the fenced SUCCESS), and a ping landing while the transaction is open would make that
        write a conflict (the transaction aborts and its body runs again). The run extends its
        lease itself when the transaction starts (``held``)."""
        with self._cond:
            lease = self._leases.get(run_id)
            if lease is not None:
                lease.paused = True

    def held(self, run_id: str, sent: float) -> float | None:
        """The run extended its own lease with a write sent at ``sent`` (monotonic): its lease
        lasts until ``sent + timeout`` at the earliest; returns that, or None if not pinged."""
        with self._cond:
            lease = self._leases.get(run_id)
            if lease is None:
                return None
            lease.renewed(max(lease.expires, sent + lease.timeout))
            return lease.expires

    def resume(self, run_id: str) -> None:
        """Ping the run again, from now on."""
        with self._cond:
            lease = self._leases.get(run_id)
            if lease is not None and lease.paused:
                lease.paused = False
                lease.next_at = time.monotonic()
                self._cond.notify()

    def hold(self, run_id: str, slot: str) -> None:
        """The run holds a place in ``slot`` from now on (taken for it: ``slots.join``): each
        ping extends it."""
        with self._cond:
            lease = self._leases.get(run_id)
            if lease is not None:
                if slot not in lease.slots:
                    lease.slots = (*lease.slots, slot)
                lease.joins.discard(slot)

    def remove(self, run_id: str) -> None:
        with self._cond:
            self._leases.pop(run_id, None)

    def _due(self) -> list[_Lease]:
        with self._cond:
            while not self._stopping:
                now = time.monotonic()
                # a lease past its local deadline is not pinged: the run is stopping
                pinged = [
                    lease
                    for lease in self._leases.values()
                    if not lease.paused and lease.expires > now
                ]
                due = [lease for lease in pinged if lease.next_at <= now]
                if due:
                    return due
                wake = min((lease.next_at for lease in pinged), default=now + 1)
                self._wake_at = min(wake, now + 1.0)
                self._cond.wait(timeout=max(self._wake_at - now, 0.0))
                self._wake_at = 0.0  # awake: a lease added now is seen by the loop above
                self._loop_watch.check()
            return []

    def _run(self) -> None:
        while True:
            due = self._due()
            if not due:
                return
            for lease in due:
                self._ping(lease)

    def _ping(self, lease: _Lease) -> None:
        sent = time.monotonic()
        if lease.paused or sent >= lease.expires:  # paused, or ran out, since it was found due
            return
        try:
            server_now = self._clock.now()
            limit = max(PING_MAX_TIME_MS, round(lease.interval * 1000))
            doc = self._driver.run(
                store.extend_lease(
                    lease.key, lease.run_id, self._worker_id, server_now, limit, lease.stopping
                )
            )
            status, slot_lost = None, None
            if doc is None:
                status = self._driver.run(store.get_status(lease.key))
            elif lease.slots:
                ms = int(doc.get("options", {}).get("worker_timeout_ms", lease.timeout * 1000))
                slot_lost = extend_slots(self._driver, self._worker_id, lease, server_now, ms)
        except StorageError as exc:
            if not self._failing:
                log.warning("cannot ping leases, retrying: %s", exc, extra={"key": lease.key})
                self._failing = True
            lease.next_at = time.monotonic() + min(lease.interval, 0.5)
            return
        if self._failing:
            log.info("pinging leases again")
            self._failing = False
        self.pings += 1
        now = time.monotonic()
        if doc is None:
            self._missed(lease, status, now)
            return
        if slot_lost is not None:  # the task is still the run's: it is given back (RELEASED)
            with self._cond:
                self._leases.pop(lease.run_id, None)
            self._lost.slot_lost(lease.run_id, slot_lost)
            return
        options = doc.get("options", {})
        lease.timeout = options.get("worker_timeout_ms", lease.timeout * 1000) / 1000
        lease.interval = ping_every(
            options.get("ping_interval_ms", lease.interval * 1000), lease.timeout * 1000
        )
        lease.next_at = now + lease.interval
        with self._cond:
            lease.renewed(sent + lease.timeout)
        if not lease.overdue_logged and now - lease.started > lease.timeout:
            lease.overdue_logged = True
            log.warning(
                "run %s of %s has run longer than its worker timeout (%.1fs); its "
                "lease is kept alive by pings",
                lease.run_id[:8],
                lease.key,
                lease.timeout,
            )

    def _missed(self, lease: _Lease, status: dict[str, Any] | None, now: float) -> None:
        """A ping matched nothing: the run is stopped. Its lease is forgotten, or, for a run
        that holds a lock or slots and whose handler still runs, pinged as stopping."""
        if LostRuns.keeps(lease.holds and not lease.stopping, lease.run_id, status):
            lease.stopping = True
            lease.next_at = now + lease.interval
        else:
            with self._cond:
                self._leases.pop(lease.run_id, None)
        self._lost.lost(lease.run_id, status)
