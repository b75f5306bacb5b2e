"""What a dispatched worker tells its relay (``ClaimReports``, and its credit), batched.

The relay's stream shows this worker's claims and successes (their ``last_write`` tags), and
the relay counts a slot given back for each success (``credit``). So the worker says only what
no event shows: ``held``, ``missed`` and ``gone`` keys, new ``names``, and its credit when the
relay's count of it would be wrong — after a failure, a release or a claim that came back
empty. Everything said in one turn of the event loop goes in one report, with ``free``,
``got`` and ``done`` (the credit, as the relay reads it: ``done`` counts the successes this
worker recorded while the relay handed it its tasks, as the relay counts their events).

At each look at the relay's lease (every few seconds) it *syncs* — the relay takes its
``done`` as the successes seen — when something happened since it last spoke and it has free
slots but was handed nothing since the last look (the relay may count too few of its
successes: it is handed work again) or holds more due keys than slots (too many); else it
acknowledges keys received since its last report if it has neither claimed nor finished
anything since the last look (its events say it is alive otherwise). It syncs too when the
relay first hands it work and when the relay's stream reopens. An idle worker says nothing.

A reporter is connected to one subscription (``got`` counts the keys received on it, as the
relay counts the keys it sent on it), and says something only while it is active: from the
relay's ``open`` until the worker finds work alone again (keys it claims then are not the
relay's business).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

KEPT_AT_MOST = 100_000
"""The keys said ``held`` a reporter remembers at most (``Reporter.kept``)."""


class Reporter:
    def __init__(self, capacity: Callable[[], int], names: Callable[[], Sequence[str]]) -> None:
        self.capacity = capacity
        """How many more tasks this worker can take, outcomes on their way counted as busy: a
        success gives its slot back to the relay through its event, anything else is said."""
        self.names = names
        self.got = 0
        """Keys received from the relay of this connection."""
        self.done = 0
        """Successes recorded while the relay hands this worker its tasks."""
        self.free: int | None = None
        """The ``free`` last said."""
        self._send: Callable[[dict[str, Any]], None] | None = None
        self.active = False
        self._said_got = 0
        self._said_done = 0
        self._said: dict[str, list[Any]] = {}
        self._names: list[str] | None = None
        self._flush: asyncio.Handle | None = None
        self._must = False
        """Something is to be said at the end of this turn, whatever the credit."""
        self._sync = False
        """What is to be said syncs the relay's count of successes (``look``)."""
        self._acted = False
        """A claim or a success since the last look (the relay heard it through its stream)."""
        self._got_at_look = 0
        self.kept: set[str] = set()
        """Keys said ``held`` to a relay and neither claimed nor let go since: that relay
        forgot them (they are this worker's), so they stay in this worker's queue when a relay
        hands it its tasks again (``Subscriber``); bounded by ``KEPT_AT_MOST``."""

    def connect(self, send: Callable[[dict[str, Any]], None], names: list[str]) -> None:
        """A new subscription: report through ``send`` (the relay knows ``names`` already)."""
        self._send, self._names, self._said, self.active = send, names, {}, False
        self.got = self.done = self._said_got = self._said_done = self._got_at_look = 0
        self.free = None

    def disconnect(self) -> None:
        self._send = None
        self.pause()

    def resume(self) -> None:
        """The relay hands this worker its tasks: say the credit, and what becomes of them (a
        sync: successes the relay saw before this worker counted them are not credit)."""
        self.active = True
        self.sync()

    def sync(self) -> None:
        """Report once this turn is over, and have the relay take ``done`` as seen."""
        self._sync = True
        self.soon()

    def pause(self) -> None:
        """The worker finds work alone: nothing to say."""
        self.active, self._said, self._must, self._sync = False, {}, False, False
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None

    def received(self, count: int) -> None:
        """Keys arrived: their claims will show in the relay's stream; ``got`` goes with the
        next report, or at the next look if nothing else says this worker is alive."""
        self.got += count

    # -- ClaimReports ----------------------------------------------------------------------------

    def claimed(self, key: str, claim_at: Any) -> None:
        """Nothing to say: the claim's event shows it (and that this worker is alive)."""
        self._acted = True
        self.kept.discard(key)

    def held(self, key: str) -> None:
        if self.active:
            if len(self.kept) >= KEPT_AT_MOST:  # bounded: a key still held back comes back
                self.kept.clear()  # by the relay's sweep
            self.kept.add(key)
        self._say("held", key)

    def succeeded(self, key: str) -> None:
        """Nothing to say: the success's event gives the relay the slot back."""
        self._acted = True
        self.kept.discard(key)
        if self.active:
            self.done += 1

    def missed(self, key: str) -> None:
        self.kept.discard(key)
        self._say("missed", key)

    def gone(self, key: str) -> None:
        self.kept.discard(key)
        self._say("gone", key)

    def _say(self, field: str, item: Any) -> None:
        if self.active:
            self._said.setdefault(field, []).append(item)
            self.soon()

    def soon(self) -> None:
        """Report once this turn of the event loop is over (one frame for all of it)."""
        self._must = True
        self.check()

    def check(self) -> None:
        """A slot may have freed: once this turn is over (when a run's end and its outcome
        on its way have both been counted), report if the relay's count is off."""
        if self.active and self._send is not None and self._flush is None:
            self._flush = asyncio.get_running_loop().call_soon(self._report)

    def changed(self) -> bool:
        """Whether the relay's count of this worker's credit is off: what was said last, less
        the keys received since, plus the successes recorded since (which it counts too)."""
        if self.free is None:
            return True
        expected = self.free - (self.got - self._said_got) + (self.done - self._said_done)
        return self.capacity() != expected

    def look(self) -> None:
        """At a look at the relay's lease (every few seconds): sync the relay's count if this
        worker has free slots and was handed nothing since the last look (the relay may count
        too few of its successes), or holds more keys than slots (too many); else acknowledge
        keys received if nothing showed this worker alive since the last look."""
        acted, self._acted = self._acted, False
        handed, self._got_at_look = self.got != self._got_at_look, self.got
        spoke = self.got != self._said_got or self.done != self._said_done
        free = self.capacity()
        if spoke and ((free > 0 and not handed) or free < 0):
            self.sync()
        elif self.got != self._said_got and not acted:
            self.soon()
        else:
            self.check()

    def _report(self) -> None:
        self._flush = None
        if not self.active or self._send is None:
            return
        if not (self._must or self._said or self.changed()):
            return
        self._must = False
        self.free, self._said_got, self._said_done = self.capacity(), self.got, self.done
        message: dict[str, Any] = {"free": self.free, "got": self.got, "done": self.done}
        if self._sync:
            message["sync"] = True
        self._sync = False
        names = list(self.names())
        if names != self._names:
            message["names"] = self._names = names
        message.update(self._said)
        self._said = {}
        self._send(message)
