"""The relay's dispatcher: one producer for every worker, on any host.

The worker process that holds the relay (``relay.py``) holds the claim queue of every
subscriber's names (``HostQueue``), fed by the relay's one change stream, its scans and its
sweep. The ``Dispatcher`` hands each due task to **one** subscriber with credit
(``credit.py``), which claims it as before: the claim still decides, and the relay never
writes to a task. So a task costs one claim attempt however many workers and hosts run.

- **The relay reads what its subscribers wrote.** Its stream carries their claims and
  successes, tagged with their worker ids (``last_write``): a claim places the task at its
  lease's end (taken over should the claimer die), a success lets it go and gives the
  subscriber's slot back (``credit``). A subscriber says only what no event shows: ``held``
  for a key a cluster-wide limit keeps back, ``missed``, ``gone`` and its credit after
  anything but a success (``finding.protocols.ClaimReports``).
- **Events are hints; the claim decides; the sweep bounds a loss.** A key handed over waits for
  its claim (``awaiting``) until ``credit.HAND_OVER_TIMEOUT`` (0.5 s; longer only while every
  claim takes longer to be heard of: ``credit.HandOvers``): then it goes back in the host
  queue, and its subscriber is *unheard* (``credit.Account.unheard``): it is handed nothing
  more until it is heard from (a claim or success in the stream, a report), so the keys a dead,
  frozen or cut-off subscriber was handed reach another within a second, and no more are lost
  to it; one not heard from within ``credit.SILENT_SUBSCRIBER`` is let go (it says hello
  again). A subscriber that goes gives its awaited keys back at once. Any event for an awaited
  key ends the wait.
- **A claim that misses is said.** The key goes back in the host queue for another subscriber,
  and is refused to that one for a while (``credit.Refusals``). A task of ``concurrency`` > 1
  that one subscriber claimed or succeeded at stays in the host queue, as its event places it,
  for the others; one found finished or deleted (``gone``) is let go.
- **Nobody races.** One relay holds the queue of every worker sharing the stream: it hands a
  task on at its claim time.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from collections.abc import Callable, Mapping
from typing import Any

from mtask import driver
from mtask.clock import Clock
from mtask.worker.claim_queue import ClaimQueue
from mtask.worker.finding.shared.credit import Account, Accounts, Channel, HandOvers, Refusals
from mtask.worker.finding.shared.group_waiters import GroupWaiters
from mtask.worker.finding.shared.host_queue import HostQueue
from mtask.worker.finding.shared.key_news import KeyNews

PRUNE_EVERY = 2.0
"""Seconds between two prunings of expired refusals."""


class Dispatcher:
    """Hands the host queue's due keys to subscribers with credit, one subscriber a key."""

    def __init__(
        self,
        host: HostQueue,
        now: Callable[[], dt.datetime],
        *,
        awaiting: HandOvers,
        wake: asyncio.Event,
        waiters: GroupWaiters,
    ) -> None:
        self.host = host
        self.now = now
        self.awaiting = awaiting
        """Keys handed over and not yet claimed (the host queue counts them as in flight:
        ``build``)."""
        self.wake = wake
        self.accounts = Accounts()
        self.refused = Refusals(host.scanner.sweep_interval)
        self._pruned = 0.0
        self._stuck = False
        """Due keys are left that no subscriber with credit may run: wait for a change."""
        self.handed = 0
        self.returned = 0
        """Keys that went back in the host queue (no claim in time, or their worker went)."""
        self.waiters = waiters
        """Who keeps a key of a group back (``held``): the relay tells them alone when the
        group's slot changes or a run of it ends."""
        self.news = KeyNews(host, now, awaiting, self.accounts, self.refused, waiters, wake)
        """What is heard of the keys handed out: the subscribers' words, the stream's tags."""
        self.said, self.heard = self.news.said, self.news.heard
        self.reports = 0
        """Credit the subscribers said (their hellos not counted)."""

    @classmethod
    def build(
        cls,
        driver: driver.AsyncDriver,
        clock: Clock,
        *,
        new_queue: Callable[[], ClaimQueue],
        sweep_interval: float,
        waiters: GroupWaiters | None = None,
    ) -> Dispatcher:
        """A dispatcher and its host queue (which counts the awaited keys as busy); ``waiters``:
        shared with the relay, which tells them."""
        awaiting = HandOvers()
        wake = asyncio.Event()
        host = HostQueue(
            driver,
            clock,
            busy=awaiting.__contains__,
            wake=wake.set,
            queue=new_queue(),
            sweep_interval=sweep_interval,
        )
        waiters = GroupWaiters() if waiters is None else waiters
        return cls(host, clock.now, awaiting=awaiting, wake=wake, waiters=waiters)

    # -- subscribers --------------------------------------------------------------------------

    def add(
        self, channel: Channel, worker_id: str, names: list[str], free: int, *, near: bool = False
    ) -> None:
        """A subscriber (``near``: in the relay's own process, handed keys first)."""
        self.accounts.add(Account(channel, worker_id, frozenset(names), free, near=near))
        self._refresh()

    def remove(self, channel: Channel) -> None:
        gone = self.accounts.remove(channel)
        if gone is None:
            return
        for key in self.awaiting.to(gone):
            self._give_back(key)
        self.refused.drop_account(gone)
        self.waiters.drop(channel)
        self._refresh()

    def report(
        self,
        channel: Channel,
        free: int,
        got: int,
        done: int,
        names: list[str] | None = None,
        sync: bool = False,
    ) -> None:
        """A subscriber's ``free`` slots, having received ``got`` keys and recorded ``done``
        successes (and its names; ``sync``: ``credit.Account.said``)."""
        account = self.accounts.get(channel)
        if account is None:
            return
        self.reports += 1
        account.said(free, got, done, time.monotonic(), sync)  # (heard from: not unheard)
        if names is not None and frozenset(names) != account.names:
            account.names = frozenset(names)
            self._refresh()
        if account.credit > 0:
            self.wake.set()

    def _refresh(self) -> None:
        """The subscribers changed: the host queue's names and worker ids follow."""
        self.host.serve(*self.accounts.scope())
        self.wake.set()

    # -- what the subscribers (ClaimReports) and the stream say about keys (KeyNews) ---------

    def held(self, key: str, by: Channel | None = None) -> None:
        self.news.held(key, by)

    def missed(self, key: str, by: Channel | None = None) -> None:
        self.news.missed(key, by)

    def gone(self, key: str) -> None:
        self.news.gone(key)

    def on_change(self, change: Mapping[str, Any]) -> None:
        self.news.on_change(change)

    def clear(self) -> None:
        """Forget what was handed out and refused (the relay's worker finds its own work)."""
        self.awaiting.clear()
        self.refused.clear()

    def _give_back(self, key: str) -> None:
        self.awaiting.pop(key, None)
        self.returned += 1
        self.host.requeue_at(key, self.now())

    def silent(self, now_mono: float) -> list[Channel]:
        """Subscribers that left handed keys unacknowledged too long (``credit.silent``)."""
        return self.accounts.silent(now_mono)

    # -- handing out ---------------------------------------------------------------------------

    async def run(self) -> None:
        """Until cancelled: hand out what is due, give back what waited too long."""
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
        """One round; returns how long to sleep at most (``None``: until woken)."""
        now_mono = time.monotonic()
        for key in self.awaiting.lapsed(now_mono):  # another subscriber gets it, and its own
            self.awaiting[key][0].lapsed(now_mono)  # is handed nothing until heard from
            self._give_back(key)
        if self.refused and now_mono - self._pruned >= PRUNE_EVERY:
            self._pruned = now_mono
            self.refused.prune(now_mono)
        now = self.now()
        self.hand_out(now)
        if self.host.queue.needs_refill(now):
            self.host.request_rescan()
        waits: list[float] = []
        next_due = self.host.queue.next_due(now)
        can_take = any(a.room > 0 for a in self.accounts)
        if next_due is not None and can_take and not (self._stuck and next_due <= now):
            waits.append(max(0.0, (next_due - now).total_seconds()))
        if (ends := self.awaiting.next_end()) is not None:
            waits.append(max(0.0, ends - now_mono))
        if self.refused:
            waits.append(PRUNE_EVERY)
        return min(waits) if waits else None

    def hand_out(self, now: dt.datetime) -> int:
        """Hand every due key a subscriber can take to one such subscriber. A key nobody with
        credit may take now does not hold up the keys behind it."""
        credit = self.accounts.credit()
        self._stuck = False
        if credit <= 0:
            return 0
        batches: dict[Account, list[Any]] = {}
        kept: list[str] = []
        while credit > 0 and (due := self.host.queue.pop_due(now, credit)):
            credit -= self._hand(due, now, batches, kept)
        for key in kept:  # due, but nobody with credit may run it now
            self.host.placement.requeue(key, now)
        self._stuck = bool(kept)
        for account, entries in batches.items():
            account.channel.dispatch(entries)
            self.handed += len(entries)
        return sum(len(e) for e in batches.values())

    def _hand(
        self, keys: list[str], now: dt.datetime, batches: dict[Account, list[Any]], kept: list[str]
    ) -> int:
        """Choose a subscriber for each of ``keys`` (popped, due); returns how many got one.
        The others go to ``kept``, or back in the queue for later if every subscriber that
        may run them refuses them now (until that changes: an event, a lease's end)."""
        handed, now_mono = 0, time.monotonic()
        for key in keys:
            meta = self.host.known(key)
            chosen = (
                None if meta is None else self.accounts.choose(key, meta, self.refused, now_mono)
            )
            if isinstance(chosen, float):
                self.host.placement.requeue(key, now + dt.timedelta(seconds=chosen - now_mono))
            elif meta is None or chosen is None:
                kept.append(key)
            else:
                handed += 1
                chosen.handed(1, now_mono)  # its credit counts it from now on
                self.awaiting.hand(key, chosen, now_mono)
                group = meta.group[1] if isinstance(meta.group, tuple) else None
                entry = [key, meta.name, meta.priority, meta.worker_timeout_ms, group]
                batches.setdefault(chosen, []).append(entry)
        return handed

    def stats(self) -> Mapping[str, int]:
        counts = {"subscribers": len(self.accounts), "handed": self.handed}
        counts |= {"returned": self.returned, "awaiting": len(self.awaiting)}
        counts |= {f"said_{kind}": n for kind, n in self.said.items()}
        counts |= {f"heard_{kind}": n for kind, n in self.heard.items()}
        counts |= {"reports": self.reports, "refused": len(self.refused)}
        return counts | {"queued": len(self.host.queue), "unheard": self.accounts.unheard()}
