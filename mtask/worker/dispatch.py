"""The relay's claim queue and its dispatcher: one producer for every worker, on any host.

With ``--stream shared`` the worker process that holds the relay (``stream_relay``) also holds
the claim queue of every subscriber (``HostQueue``, a ``Watcher`` for every subscriber's
names), fed by the relay's one change stream, its scans and its sweep. The ``Dispatcher`` hands each
due task to **one** subscriber with a free slot, which claims it as before: the claim still
decides, and the relay never writes to a task. So a task costs one claim attempt however many
workers and hosts run, and each event is read by one process, not by all of them.

- **Credit.** A subscriber says how many more tasks it can take (``free``: its slots less its
  runs, claims on their way and keys waiting in its queue) and how many handed-over keys it has
  received (``got``). Its credit is ``free - (sent - got)``: what the relay may still send it.
- **The relay knows what its subscribers wrote.** Its stream leaves out their claims and
  successes (the ``last_write`` tag, as an own stream leaves out its worker's): a subscriber
  tells the relay instead (``claimed`` with the lease's end, ``succeeded``), and ``held`` for a
  key a cluster-wide limit keeps back.
- **Events are hints; the claim decides; the sweep bounds a loss.** A key handed over waits for
  its claim (``awaiting``) until ``HAND_OVER_TIMEOUT``: then it goes back in the host queue. A
  subscriber that goes gives its awaited keys back at once. Any event for an awaited key ends
  the wait (another worker claimed it, it was cancelled, it failed). The queue rescans when
  the stream (re)opens and every sweep.
- **A claim that misses is said.** A subscriber whose claim of a due key missed (it may not run
  it: a task of ``concurrency`` > 1 it runs or ran already) says ``missed``; the key goes back
  in the host queue for another subscriber, and is not handed to that one again until an event
  for the key or a sweep interval has passed (``refused``). A task of ``concurrency`` > 1 that
  one subscriber claimed stays in the host queue for the others; one it succeeded at is read
  again (it may be open still: no event says so); one found finished or deleted (``gone``) is
  let go.
- **Nobody races.** One relay holds the queue of every worker of the tasks collection: it
  hands a task on at its claim time (``HostQueue.rank`` is 0).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from mtask.worker.watcher import Watcher

log = logging.getLogger(__name__)

HAND_OVER_TIMEOUT = 5.0
"""Seconds a handed-over key waits for its claim before it goes back in the host queue."""
TICK = 2.0
"""Seconds between two frames to an idle subscriber: the relay is alive (``stream_relay``)."""


class Channel(Protocol):
    """Where a subscriber's frames go (a connection, or a worker in the relay's own loop)."""

    def dispatch(self, entries: list[list[Any]]) -> None: ...

    def tick(self) -> None: ...


@dataclass(eq=False)
class Subscriber:
    """A subscribed worker, as the relay sees it."""

    channel: Channel
    worker_id: str
    names: frozenset[str]
    free: int
    """Tasks it said it can take, when it last said so."""
    sent: int = 0
    """Keys handed to it so far."""
    got: int = 0
    """Keys it had received when it last said ``free``."""
    last_frame: float = field(default_factory=time.monotonic)

    @property
    def credit(self) -> int:
        return self.free - (self.sent - self.got)


class HostQueue(Watcher):
    """The relay's claim queue, for every subscribed worker on any host (the name is from when
    there was one relay per host): a ``Watcher`` whose names are its subscribers' and whose
    tasks may name any of them in ``specific_worker_ids``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._names: list[str] = []
        super().__init__(*args, **kwargs)
        self.worker_ids: tuple[str, ...] = ()
        self.specific: dict[str, frozenset[str]] = {}
        """The ``specific_worker_ids`` of queued tasks that name some."""
        self.multi: set[str] = set()
        """Queued tasks of ``concurrency`` > 1 (several subscribers may run each)."""
        self.active = True
        """False while the relay's own worker is its only subscriber and finds its own work:
        the host queue then holds nothing and scans nothing."""

    async def rescan(self) -> int:
        return await super().rescan() if self.active else 0

    @property
    def names(self) -> list[str]:
        """Every subscriber's names."""
        return self._names

    @names.setter
    def names(self, names: list[str]) -> None:
        self._names = list(names)

    @property
    def scan_ids(self) -> str | tuple[str, ...]:
        return self.worker_ids

    def may_run(self, key: str, specific: list[Any]) -> bool:
        if not specific:
            self.specific.pop(key, None)
            return True
        allowed = frozenset(s for s in specific if isinstance(s, str))
        if allowed.isdisjoint(self.worker_ids):
            return False
        self.specific[key] = allowed
        return True

    def rank(self, key: str, name: str) -> int:
        """0: one relay holds the queue of every worker of the tasks collection, so no other
        relay races it for a task (workers with own streams stagger among themselves)."""
        return 0

    def place(self, doc: Mapping[str, Any]) -> None:
        super().place(doc)
        key = doc["_id"]
        if len(self.multi) > len(self.meta):  # the watcher let its memory go (bounded)
            self.multi &= self.meta.keys()
            self.specific = {k: v for k, v in self.specific.items() if k in self.meta}
        concurrency = (doc.get("options") or {}).get("concurrency")
        if key in self.meta and isinstance(concurrency, int) and concurrency > 1:
            self.multi.add(key)
        else:
            self.multi.discard(key)

    def forget(self, key: str) -> None:
        super().forget(key)
        self.specific.pop(key, None)
        self.multi.discard(key)


class Dispatcher:
    """Hands the host queue's due keys to subscribers with credit, one subscriber a key."""

    def __init__(self, host: HostQueue, now: Callable[[], dt.datetime]) -> None:
        self.host = host
        self.now = now
        self.subscribers: dict[Channel, Subscriber] = {}
        self.awaiting: dict[str, tuple[Subscriber, float]] = {}
        """Keys handed over and not yet claimed: to whom, and until when (monotonic)."""
        self.wake = asyncio.Event()
        self._turn = 0
        self._pruned = 0.0
        self._stuck = False
        """Due keys are left that no subscriber with credit may run: wait for a change."""
        self.refused: dict[str, dict[Subscriber, float]] = {}
        """Keys some subscribers cannot claim now: who, and until when (monotonic)."""
        self.handed = 0
        self.returned = 0
        """Keys that went back in the host queue (no claim in time, or their worker went)."""

    # -- subscribers --------------------------------------------------------------------------

    def add(self, channel: Channel, worker_id: str, names: list[str], free: int) -> None:
        self.subscribers[channel] = Subscriber(channel, worker_id, frozenset(names), free)
        self._refresh()

    def remove(self, channel: Channel) -> None:
        gone = self.subscribers.pop(channel, None)
        if gone is None:
            return
        for key, (to, _) in list(self.awaiting.items()):
            if to is gone:
                self._give_back(key)
        for key, subs in list(self.refused.items()):
            subs.pop(gone, None)
            if not subs:
                del self.refused[key]
        self._refresh()

    def report(self, channel: Channel, free: int, got: int, names: list[str] | None = None) -> None:
        """A subscriber's ``free`` slots, having received ``got`` keys (and its names)."""
        sub = self.subscribers.get(channel)
        if sub is None:
            return
        sub.free, sub.got = free, got
        if names is not None and frozenset(names) != sub.names:
            sub.names = frozenset(names)
            self._refresh()
        if sub.credit > 0:
            self.wake.set()

    def _refresh(self) -> None:
        """The subscribers changed: the host queue's names and worker ids follow; new names
        or workers may have tasks already, so the host queue scans again."""
        names = sorted(set().union(*(s.names for s in self.subscribers.values())))
        ids = tuple(sorted(s.worker_id for s in self.subscribers.values()))
        grew = not set(names) <= set(self.host.names) or not set(ids) <= set(self.host.worker_ids)
        self.host.names = names
        self.host.worker_ids = ids
        if grew:
            self.host.request_rescan()
        self.wake.set()

    # -- what the subscribers and the stream say about keys -----------------------------------

    def claimed(self, key: str, claim_at: Any, by: Channel | None = None) -> None:
        """A subscriber claimed ``key``: next claimable at ``claim_at`` (its lease's end, or now
        while a task of ``concurrency`` > 1 has a free slot), when the host queue takes it over
        should the claimer die."""
        self._end_wait(key, by)
        if not isinstance(claim_at, dt.datetime):
            self.forget(key)
            return
        if key in self.host.multi:  # it runs it: the next slot is for another subscriber
            self._refuse(key, by)
        if key in self.host.meta:
            self.host.requeue_at(key, claim_at)

    def held(self, key: str) -> None:
        """A subscriber keeps ``key`` (a limit holds it back): not the host queue's any more."""
        self.awaiting.pop(key, None)
        self.forget(key)

    def succeeded(self, key: str, by: Channel | None = None) -> None:
        """A subscriber recorded a success of ``key`` (its event is not in the stream)."""
        self._end_wait(key, by)
        if key in self.host.multi and key in self.host.meta:
            # concurrency > 1: it may be open still, for another subscriber; the host queue
            # reads it again (``settle``, within a stream wait), and places it or lets it go
            self._refuse(key, by)
            self.host.unknown.add(key)
            self.host.queue.discard(key)
        else:
            self.refused.pop(key, None)
            self.host.succeeded(key)

    def missed(self, key: str, by: Channel | None = None) -> None:
        """A subscriber's claim of ``key`` missed although it was due: hand it to another."""
        self._end_wait(key, by)
        self._refuse(key, by)
        if key in self.host.meta:
            self.host.requeue_at(key, self.now())

    def gone(self, key: str) -> None:
        """A subscriber found ``key`` finished or deleted."""
        self.awaiting.pop(key, None)
        self.forget(key)

    def forget(self, key: str) -> None:
        self.refused.pop(key, None)
        self.host.forget(key)

    def _end_wait(self, key: str, by: Channel | None) -> None:
        """``by`` said what became of ``key``: if it was handed to ``by``, the wait is over
        (a task of ``concurrency`` > 1 may be on its way to another subscriber meanwhile)."""
        waiting = self.awaiting.get(key)
        if waiting is not None and (by is None or waiting[0].channel is by):
            del self.awaiting[key]

    def _refuse(self, key: str, by: Channel | None) -> None:
        """Do not hand ``key`` to ``by`` for a sweep interval, or until an event for it comes
        (it runs or ran it, or its claim missed): the sweep bounds a mistake."""
        sub = None if by is None else self.subscribers.get(by)
        if sub is not None:
            self.refused.setdefault(key, {})[sub] = time.monotonic() + self.host.sweep_interval

    def _refusers(self, key: str, now_mono: float) -> dict[Subscriber, float]:
        subs = self.refused.get(key)
        if subs is None:
            return {}
        for sub in [s for s, until in subs.items() if until <= now_mono]:
            del subs[sub]
        if not subs:
            del self.refused[key]
        return subs

    def on_event(self, key: Any) -> None:
        """The stream said something of ``key``: a wait for its claim is over, and whoever
        could not claim it may try again. A key that is not a string is never handed out
        (the host queue notes its document for quarantine)."""
        if isinstance(key, str):
            self.awaiting.pop(key, None)
            self.refused.pop(key, None)

    def clear(self) -> None:
        """Forget the host's tasks (its one worker finds its own work again)."""
        self.host.active = False
        self.awaiting.clear()
        self.refused.clear()
        self.host.queue.clear()
        self.host.meta.clear()
        self.host.specific.clear()
        self.host.multi.clear()

    def _give_back(self, key: str) -> None:
        self.awaiting.pop(key, None)
        self.returned += 1
        if key in self.host.meta:
            self.host.requeue_at(key, self.now())

    # -- handing out ---------------------------------------------------------------------------

    async def run(self) -> None:
        """Until cancelled: hand out what is due, give back what waited too long, tick."""
        while True:
            self.wake.clear()
            timeout = self.run_once()
            if timeout is None or timeout > 0:
                try:
                    async with asyncio.timeout(timeout):
                        await self.wake.wait()
                except TimeoutError:
                    pass

    def run_once(self) -> float | None:
        """One round; returns how long to sleep at most."""
        now_mono = time.monotonic()
        for key, (_, until) in list(self.awaiting.items()):
            if until <= now_mono:
                self._give_back(key)
        if now_mono - self._pruned >= TICK:
            self._pruned = now_mono
            for key in list(self.refused):
                self._refusers(key, now_mono)
        now = self.now()
        self.hand_out(now)
        if self.host.queue.needs_refill(now):
            self.host.request_rescan()
        for sub in self.subscribers.values():
            if now_mono - sub.last_frame >= TICK:
                sub.channel.tick()
                sub.last_frame = now_mono
        waits = [TICK]
        next_due = self.host.queue.next_due(now)
        can_take = any(s.credit > 0 for s in self.subscribers.values())
        if next_due is not None and can_take and not (self._stuck and next_due <= now):
            waits.append(max(0.0, (next_due - now).total_seconds()))
        if self.awaiting:
            waits.append(max(0.0, min(u for _, u in self.awaiting.values()) - now_mono))
        return min(waits)

    def hand_out(self, now: dt.datetime) -> int:
        """Hand every due key a subscriber can take to one such subscriber. A key nobody with
        credit may take now does not hold up the keys behind it (they are read on until the
        credit is spent or no key is due)."""
        credit = sum(max(0, s.credit) for s in self.subscribers.values())
        self._stuck = False
        if credit <= 0:
            return 0
        batches: dict[Subscriber, list[list[Any]]] = {}
        kept: list[str] = []
        now_mono = time.monotonic()
        deadline = now_mono + HAND_OVER_TIMEOUT
        while credit > 0 and (due := self.host.queue.pop_due(now, credit)):
            credit -= self._hand(due, now, now_mono, deadline, batches, kept)
        for key in kept:  # due, but nobody with credit may run it now
            meta = self.host.meta.get(key)
            if meta is not None:
                self.host.queue.push(key, now, meta.priority, meta.specific)
        self._stuck = bool(kept)
        for sub, entries in batches.items():
            sub.channel.dispatch(entries)
            sub.last_frame = time.monotonic()
            self.handed += len(entries)
        return sum(len(e) for e in batches.values())

    def _hand(
        self,
        keys: list[str],
        now: dt.datetime,
        now_mono: float,
        deadline: float,
        batches: dict[Subscriber, list[list[Any]]],
        kept: list[str],
    ) -> int:
        """Choose a subscriber for each of ``keys`` (popped, due); returns how many got one.
        The others go to ``kept``, or back in the queue for later if every subscriber that
        may run them refuses them now."""
        handed = 0
        for key in keys:
            meta = self.host.meta.get(key)
            refusers = self._refusers(key, now_mono)
            sub = None if meta is None else self._choose(key, meta.name, refusers)
            if meta is not None and sub is None and refusers:
                retry = self._all_refused(key, meta.name, refusers)
                if retry is not None:
                    # every subscriber that may take it cannot claim it now: until that
                    # changes (an event, a lease's end), it waits out of the way
                    after = dt.timedelta(seconds=retry - now_mono)
                    self.host.queue.push(key, now + after, meta.priority, meta.specific)
                    continue
            if meta is None or sub is None:
                kept.append(key)
                continue
            sub.sent += 1
            handed += 1
            self.awaiting[key] = (sub, deadline)
            batches.setdefault(sub, []).append(
                [key, meta.name, meta.priority, meta.worker_timeout_ms]
            )
        return handed

    def _all_refused(self, key: str, name: str, refusers: dict[Subscriber, float]) -> float | None:
        """When every subscriber that may run ``key`` refuses it: the first refusal's end."""
        allowed = self.host.specific.get(key)
        for sub in self.subscribers.values():
            eligible = name in sub.names and (allowed is None or sub.worker_id in allowed)
            if eligible and sub not in refusers:
                return None
        return min(refusers.values())

    def _choose(
        self, key: str, name: str, refusers: Mapping[Subscriber, float] | None = None
    ) -> Subscriber | None:
        """The next subscriber (round robin) with credit that runs ``name``, may run ``key``
        and did not just fail to claim it."""
        subs = list(self.subscribers.values())
        allowed: frozenset[str] | None = self.host.specific.get(key)
        for i in range(len(subs)):
            sub = subs[(self._turn + i) % len(subs)]
            if sub.credit <= 0 or name not in sub.names or (refusers and sub in refusers):
                continue
            if allowed is not None and sub.worker_id not in allowed:
                continue
            self._turn = (self._turn + i + 1) % len(subs)
            return sub
        return None

    @classmethod
    def build(
        cls,
        driver: Any,
        worker_id: str,
        clock: Any,
        assignment: Any,
        sweep_interval: float,
        stagger_ms: float,
        queue_size: int,
    ) -> Dispatcher:
        """A dispatcher and its host queue, for the relay of ``worker_id``'s process."""
        from mtask.worker.claim_queue import ClaimQueue

        holder: list[Dispatcher] = []
        host = HostQueue(
            driver,
            worker_id=worker_id,
            queue=ClaimQueue(queue_size),
            clock=clock,
            wake=lambda: holder[0].wake.set(),
            in_flight=lambda key: key in holder[0].awaiting,
            sweep_interval=sweep_interval,
            stagger_ms=stagger_ms,
            assignment=assignment,
        )
        holder.append(cls(host, clock.now))
        return holder[0]

    def stats(self) -> Mapping[str, int]:
        return {
            "subscribers": len(self.subscribers),
            "handed": self.handed,
            "returned": self.returned,
            "awaiting": len(self.awaiting),
            "refused": len(self.refused),
            "queued": len(self.host.queue),
        }
