"""What the relay hears of the keys its dispatcher handed out (``KeyNews``), beside the handing
out itself (``dispatch.Dispatcher``).

- **The subscribers' words** (``finding.protocols.ClaimReports``): a key ``held`` back by a
  limit is the subscriber's now (and, for a group's key, it waits for that group's news alone:
  ``waiters``); one ``missed`` goes back in the host queue for another subscriber, and is refused
  to that one for a while (``credit.Refusals``); one ``gone`` is let go.
- **The stream's tags** (``last_write``): a subscriber's claim or success ends the wait for
  the key's claim, is heard from it (an unheard subscriber is handed keys again), and a success
  gives its slot back; a task of ``concurrency`` > 1 it claimed or succeeded at is refused to it
  (the next slot is another's). Then the host queue places the key as the event says.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from collections.abc import Callable, Mapping
from typing import Any

from mtask.store.schema import LAST_WRITE
from mtask.worker.finding.changes import event_key, updated_fields
from mtask.worker.finding.shared.credit import Account, Accounts, Channel, HandOvers, Refusals
from mtask.worker.finding.shared.group_waiters import GroupWaiters
from mtask.worker.finding.shared.host_queue import HostQueue


class KeyNews:
    """What the subscribers and the stream say of the keys handed out, and what it changes."""

    def __init__(
        self,
        host: HostQueue,
        now: Callable[[], dt.datetime],
        awaiting: HandOvers,
        accounts: Accounts,
        refused: Refusals,
        waiters: GroupWaiters,
        wake: asyncio.Event,
    ) -> None:
        self.host = host
        self.now = now
        self.awaiting = awaiting
        self.accounts = accounts
        self.refused = refused
        self.waiters = waiters
        self.wake = wake
        """The dispatcher's wake-up: a subscriber has credit again."""
        self.said = {"held": 0, "missed": 0, "gone": 0}
        """What the subscribers said of handed keys, by kind."""
        self.heard = {"claim": 0, "success": 0}
        """The subscribers' claims and successes the stream showed."""

    def held(self, key: str, by: Channel | None = None) -> None:
        """A subscriber keeps ``key`` (a limit holds it back): not the host queue's any more.
        If the task has a group, ``by`` is told when its group's slot document changes or a run
        of the group ends (``waiters``): those go only to who waits for them."""
        self.said["held"] += 1
        meta = self.host.known(key)
        group = meta.group if meta is not None and isinstance(meta.group, tuple) else None
        self.waiters.held(key, group, by)
        self.awaiting.forget(key)
        self.forget(key)

    def missed(self, key: str, by: Channel | None = None) -> None:
        """A subscriber's claim of ``key`` missed although it was due: hand it to another (a
        key this relay forgot, said ``held`` before, is read again first)."""
        self.said["missed"] += 1
        self.awaiting.end(key, by)
        self.refused.add(key, self.accounts.get(by))
        if self.host.known(key) is None:
            self.host.read_again(key)
        else:
            self.host.requeue_at(key, self.now())

    def gone(self, key: str) -> None:
        """A subscriber found ``key`` finished or deleted."""
        self.said["gone"] += 1
        self.awaiting.forget(key)
        self.waiters.known_again(key)
        self.forget(key)

    def forget(self, key: str) -> None:
        self.refused.drop_key(key)
        self.host.forget(key)

    def on_change(self, change: Mapping[str, Any]) -> None:
        """A task's event in the relay's stream: what it says of the subscribers, then its
        place in the host queue (a claim's at its lease's end, a success's nowhere)."""
        self._on_event(change)
        if isinstance(key := event_key(change), str):
            self.waiters.known_again(key)  # the host queue learns the task again
        self.host.on_change(change)

    def _on_event(self, change: Mapping[str, Any]) -> None:
        """A wait for the task's claim is over, and whoever could not claim it may try again
        (a key that is not a string is never handed out). A subscriber's claim or success (its
        tag) is heard from it, and a success gives its slot back; a task of ``concurrency`` > 1
        it claimed or succeeded at is refused to it (the next slot is another's)."""
        key = event_key(change)
        if not isinstance(key, str):
            return
        self.awaiting.heard(key, time.monotonic())
        fields = updated_fields(change)
        kind, account = _writer(fields, self.accounts)
        if account is None:
            self.refused.drop_key(key)
            return
        self.heard[kind] += 1
        if kind == "success":
            account.seen += 1
            if account.credit > 0:
                self.wake.set()
        if account.unacked_since is not None or account.unheard:  # alive: the clock starts
            if account.unheard:  # again, if keys wait; handed keys again
                self.wake.set()
            account.heard(self.awaiting.waits_for(account), time.monotonic())
        meta = self.host.known(key)
        if meta is not None and meta.multi:
            self.refused.add(key, account)
            if "next_claim_at" not in fields:  # a slot left, or not: read it
                self.host.read_again(key)
        else:
            self.refused.drop_key(key)


def _writer(fields: Mapping[str, Any], accounts: Accounts) -> tuple[str, Account | None]:
    """Whose claim or success an update that set ``fields`` is, by its ``last_write``."""
    tag = fields.get(LAST_WRITE)
    if not isinstance(tag, str):
        return "", None
    kind, _, worker_id = tag.partition(":")
    if kind not in ("claim", "success"):
        return "", None
    return kind, accounts.by_worker.get(worker_id)
