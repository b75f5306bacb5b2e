"""The relay's books on its subscribers: their credit, and who may not take a key now.

- **Credit.** A subscriber says how many more tasks it can take (``free``: its slots less its
  runs, claims on their way, outcomes on their way and keys waiting in its queue), how many
  handed-over keys it has received (``got``) and how many successes it has recorded (``done``)
  when it says so. Between two reports the relay counts the subscriber's successes itself, from
  their events in its stream (``seen``: the ``success:<worker id>`` tag): each gives a slot
  back. Its credit is ``free - (sent - got) + max(0, seen - done)``: what the relay may still
  send it. A success whose event comes after the report that counted it is not counted twice,
  nor one counted by the relay before a report that had not; so a subscriber whose work goes
  well says nothing at all, and one that fails, misses or holds a key says so.
- **Counts that drift are synced.** The two counts of successes can come apart (an event the
  relay never saw, one seen just before a subscription was counted; a success whose outcome
  write was fenced in part). A relay that counts too few starves the subscriber; one that counts
  too many hands it keys it must queue. So a subscriber that did something since it last spoke
  *syncs* (the relay takes its ``done`` as the successes seen) at a look that finds it with free
  slots and nothing handed since the previous look, or with more due keys than slots; and when
  it is first handed work, and when the relay's stream reopens. That costs one report per host
  when its work stops, none while it flows.
- **Acknowledgement.** A live subscriber is heard: its claims and successes in the relay's
  stream, or a report; one that has neither claimed nor finished anything for a look says
  ``got``. One that leaves keys unacknowledged for ``SILENT_SUBSCRIBER`` seconds is dead,
  frozen or cut off, and the relay lets it go. An idle subscriber is asked nothing and costs
  nothing. One that lets a hand-over lapse (``HandOvers``) is *unheard*: it is
  handed nothing until it is heard from again.
- **Refusals.** A subscriber that cannot claim a key now (its claim missed, or it runs the key
  already: ``concurrency`` > 1) is not handed that key again for a sweep interval, or until an
  event for the key comes: the sweep bounds a mistake.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from mtask.worker.finding.placement import TaskMeta

SILENT_SUBSCRIBER = 10.0
"""Seconds a subscriber may leave handed keys unacknowledged before the relay lets it go."""
HAND_OVER_TIMEOUT = 0.5
"""Seconds a handed-over key waits for its claim (its event in the relay's stream, or a word of
its subscriber) before it goes back in the host queue, for another subscriber: a live one claims
in milliseconds (``HandOvers.timeout``: longer while claims take longer to be heard of)."""
HAND_OVER_MOST = 5.0
"""The longest a hand-over waits, however slow the cluster (what it always waited before)."""


class Channel(Protocol):
    """Where a subscriber's handed keys go (its inbox, or a worker in the relay's own loop)."""

    def dispatch(self, entries: list[list[Any]]) -> None: ...


@dataclass(eq=False)
class Account:
    """A subscribed worker, as the relay's dispatcher sees it."""

    channel: Channel
    worker_id: str
    names: frozenset[str]
    free: int
    """Tasks it said it can take, when it last said so."""
    near: bool = False
    """In the relay's own process: a key handed to it costs no write and no read (no inbox)."""
    sent: int = 0
    """Keys handed to it so far."""
    got: int = 0
    """Keys it had received when it last said ``free``."""
    done: int = 0
    """Successes it had recorded when it last said ``free``."""
    seen: int = 0
    """Its successes the relay's stream has shown so far."""
    unacked_since: float | None = None
    """Since when (monotonic) keys sent to it wait to be heard of."""
    unheard: bool = False
    """A key handed to it waited out its hand-over: nothing more is handed to it until it is
    heard from (a claim, a success, a report)."""

    @property
    def credit(self) -> int:
        return self.free - (self.sent - self.got) + max(0, self.seen - self.done)

    @property
    def room(self) -> int:
        """What may be handed to it now: its credit, none while it is unheard."""
        return 0 if self.unheard else max(0, self.credit)

    def may_take(self, name: str, allowed: frozenset[str]) -> bool:
        return name in self.names and (not allowed or self.worker_id in allowed)

    def handed(self, count: int, now_mono: float) -> None:
        if self.unacked_since is None:  # from now on it has to be heard from
            self.unacked_since = now_mono
        self.sent += count

    def said(self, free: int, got: int, done: int, now_mono: float, sync: bool = False) -> None:
        """A report (``sync``: the relay takes ``done`` as the successes seen)."""
        self.free, self.got, self.done = free, got, done
        if sync:
            self.seen = done
        self.unacked_since = None if got >= self.sent else now_mono
        self.unheard = False

    def lapsed(self, now_mono: float) -> None:
        """A key handed to it waited out its hand-over: nothing more is handed to it until it
        is heard from, and if it is not within ``SILENT_SUBSCRIBER`` (an idle subscriber whose
        last report counted that key says nothing more), it is let go as silent and says hello
        again: never handed nothing for good."""
        self.unheard = True
        if self.unacked_since is None:
            self.unacked_since = now_mono

    def heard(self, waiting: bool, now_mono: float) -> None:
        """Its claim or success came through the stream: alive (the clock starts again for
        the keys it still has to claim, if any)."""
        self.unacked_since = now_mono if waiting else None
        self.unheard = False


class HandOvers(dict[str, tuple[Account, float]]):
    """Keys handed over and not yet claimed: to whom, and until when (monotonic).

    A hand-over lapses ``HAND_OVER_TIMEOUT`` after it (a live subscriber claims in
    milliseconds), or later while the cluster is slower than that, as TCP's retransmission
    timeout (RFC 6298): the time a claim has recently taken to be heard of (its event in the
    relay's stream), four deviations added; doubled at each round that saw lapses, until a claim
    is heard in time again; a key handed again after a lapse teaches nothing (Karn: whose claim
    it is, is not known). Up to ``HAND_OVER_MOST``. Under a load that delays every claim past the
    floor, lapses at the floor would hand every key twice, and the load grow with them."""

    def __init__(self) -> None:
        super().__init__()
        self.since: dict[str, float] = {}
        """When (monotonic) each key was handed over, but after a lapse."""
        self.retried: set[str] = set()
        """Keys handed again after a lapse, until their event comes."""
        self.heard_in: float | None = None
        """How long a claim has taken to be heard of, smoothed (seconds)."""
        self.deviation = 0.0
        self.backoff = 1

    def timeout(self) -> float:
        base = HAND_OVER_TIMEOUT
        if self.heard_in is not None:
            base = max(base, self.heard_in + 4 * self.deviation)
        return min(HAND_OVER_MOST, base * self.backoff)

    def hand(self, key: str, account: Account, now_mono: float) -> None:
        self[key] = (account, now_mono + self.timeout())
        if key not in self.retried:
            self.since[key] = now_mono

    def heard(self, key: str, now_mono: float) -> None:
        """An event for ``key``: any wait is over, and how long it took is learnt."""
        self.pop(key, None)
        self.retried.discard(key)
        if (since := self.since.pop(key, None)) is None:
            return
        took, self.backoff = now_mono - since, 1
        if self.heard_in is None:
            self.heard_in, self.deviation = took, took / 2
        else:
            self.deviation += (abs(took - self.heard_in) - self.deviation) / 4
            self.heard_in += (took - self.heard_in) / 8

    def lapsed(self, now_mono: float) -> list[str]:
        """The keys whose hand-over has run out (the next ones wait twice as long)."""
        keys = [key for key, (_, until) in self.items() if until <= now_mono]
        if keys:
            self.backoff = min(2 * self.backoff, 64)
        for key in keys:
            self.since.pop(key, None)
            self.retried.add(key)
        old = [k for k, at in self.since.items() if now_mono - at > 2 * HAND_OVER_MOST]
        for key in old:  # (their event never came: a key forgotten, a task gone)
            del self.since[key]
        if len(self.retried) > 100_000:
            self.retried.clear()  # bounded: such a key teaches something again
        return keys

    def forget(self, key: str) -> None:
        self.pop(key, None)
        self.since.pop(key, None)
        self.retried.discard(key)

    def clear(self) -> None:
        self.since.clear()
        self.retried.clear()
        super().clear()

    def end(self, key: str, by: Channel | None) -> None:
        """``by`` said what became of ``key``: if it was handed to ``by``, the wait is over."""
        if (waiting := self.get(key)) and (by is None or waiting[0].channel is by):
            del self[key]

    def to(self, account: Account) -> list[str]:
        return [key for key, (to, _) in self.items() if to is account]

    def waits_for(self, account: Account) -> bool:
        return any(to is account for to, _ in self.values())

    def next_end(self) -> float | None:
        return min((until for _, until in self.values()), default=None)


class Refusals:
    """Keys some subscribers cannot claim now: who, and until when (monotonic)."""

    def __init__(self, hold: float) -> None:
        self.hold = hold
        self.by_key: dict[str, dict[Account, float]] = {}

    def __len__(self) -> int:
        return len(self.by_key)

    def add(self, key: str, account: Account | None) -> None:
        if account is not None:
            self.by_key.setdefault(key, {})[account] = time.monotonic() + self.hold

    def of(self, key: str, now_mono: float) -> dict[Account, float]:
        """Who refuses ``key`` now (expired refusals go)."""
        subs = self.by_key.get(key)
        if subs is None:
            return {}
        for sub in [s for s, until in subs.items() if until <= now_mono]:
            del subs[sub]
        if not subs:
            del self.by_key[key]
        return subs

    def prune(self, now_mono: float) -> None:
        for key in list(self.by_key):
            self.of(key, now_mono)

    def drop_key(self, key: str) -> None:
        self.by_key.pop(key, None)

    def drop_account(self, account: Account) -> None:
        for key, subs in list(self.by_key.items()):
            subs.pop(account, None)
            if not subs:
                del self.by_key[key]

    def clear(self) -> None:
        self.by_key.clear()


@dataclass
class Accounts:
    """The subscribers in the order the dispatcher turns through them."""

    by_channel: dict[Channel, Account] = field(default_factory=dict)
    by_worker: dict[str, Account] = field(default_factory=dict)
    """The same accounts by worker id (a worker subscribes once: its tags name it)."""
    near: list[Account] = field(default_factory=list)
    """The accounts in the relay's own process, which ``choose`` tries first."""
    turn: int = 0

    def __len__(self) -> int:
        return len(self.by_channel)

    def __iter__(self) -> Iterator[Account]:
        return iter(list(self.by_channel.values()))

    def get(self, channel: Channel | None) -> Account | None:
        return None if channel is None else self.by_channel.get(channel)

    def add(self, account: Account) -> None:
        self.by_channel[account.channel] = account
        self.by_worker[account.worker_id] = account
        if account.near:
            self.near.append(account)

    def remove(self, channel: Channel) -> Account | None:
        gone = self.by_channel.pop(channel, None)
        if gone is not None and self.by_worker.get(gone.worker_id) is gone:
            del self.by_worker[gone.worker_id]
        if gone is not None and gone.near:
            self.near.remove(gone)
        return gone

    def credit(self) -> int:
        return sum(a.room for a in self.by_channel.values())

    def unheard(self) -> int:
        return sum(a.unheard for a in self.by_channel.values())

    def scope(self) -> tuple[list[str], tuple[str, ...]]:
        """Every subscriber's names, and their worker ids (what the host queue serves)."""
        accounts = list(self.by_channel.values())
        names = sorted(set().union(*(a.names for a in accounts)))
        return names, tuple(sorted(a.worker_id for a in accounts))

    def silent(self, now_mono: float) -> list[Channel]:
        """Subscribers that left handed keys unacknowledged for ``SILENT_SUBSCRIBER``."""
        return [
            a.channel
            for a in self.by_channel.values()
            if a.unacked_since is not None and now_mono - a.unacked_since > SILENT_SUBSCRIBER
        ]

    def choose(
        self, key: str, meta: TaskMeta, refused: Refusals, now_mono: float
    ) -> Account | float | None:
        """A subscriber with credit left that may run the key and did not just fail to claim
        it: one in the relay's own process first (``near``: handing it the key costs the server
        nothing), else the next in turn (round robin). If every subscriber that may run it
        refuses it: when the first refusal ends (monotonic); ``None``: nobody may take it now."""
        refusers = refused.of(key, now_mono)
        for account in self.near:
            if _may_hand(account, meta, refusers):
                return account
        accounts = list(self.by_channel.values())
        for i in range(len(accounts)):
            account = accounts[(self.turn + i) % len(accounts)]
            if not account.near and _may_hand(account, meta, refusers):
                self.turn = (self.turn + i + 1) % len(accounts)
                return account
        return self._all_refuse(meta, refusers) if refusers else None

    def _all_refuse(self, meta: TaskMeta, refusers: Mapping[Account, float]) -> float | None:
        """When every subscriber that may run the key refuses it: the first refusal's end."""
        for account in self.by_channel.values():
            if account.may_take(meta.name, meta.specific) and account not in refusers:
                return None
        return min(refusers.values())


def _may_hand(account: Account, meta: TaskMeta, refusers: Mapping[Account, float]) -> bool:
    """Whether ``account`` has credit left, is not unheard, may run the key and did not just
    fail to claim it."""
    return (
        account.room > 0 and account not in refusers and account.may_take(meta.name, meta.specific)
    )
