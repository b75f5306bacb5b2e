"""What a dispatched worker tells its relay (``ClaimReports``, and its credit), batched.

The relay's stream shows this worker's claims and successes (their ``last_write`` tags), and
the relay counts a slot given back for each success (``credit``). So the worker says only what
no event shows: ``held``, ``missed`` and ``gone`` keys, new ``names``, and its credit when the
relay's count of it would be wrong — after a failure, a release or a claim that came back
empty. Everything said in one turn of the event loop goes in one report, with ``free``,
``got`` and ``done`` (the credit, as the relay reads it). Keys it was handed and has not
claimed after a look at the relay's lease are acknowledged then (``got``), and once nothing of
its has been on its way for ``QUIET_LOOKS`` looks it says its counts once (a quiet report:
``credit``). A reporter is
connected to one subscription (``got`` counts the keys received on it, as the relay counts the
keys it sent on it), and says something only while it is active: from the relay's ``open``
until the worker finds work alone again (keys it claims then are not the relay's business).
``done`` counts the successes of keys it was handed and then claimed while active, as the
relay counts them (``credit.Attribution``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Sequence
from typing import Any

QUIET_LOOKS = 3
"""Looks in a row that find nothing of this worker's on its way before it makes a quiet report
(about 9 s): the counts agree again without a report per task of a trickle."""


class Reporter:
    def __init__(
        self,
        capacity: Callable[[], int],
        names: Callable[[], Sequence[str]],
        busy: Callable[[str], bool],
    ) -> None:
        self.capacity = capacity
        """How many more tasks this worker can take, outcomes on their way counted as busy: a
        success gives its slot back to the relay through its event, anything else is said."""
        self.names = names
        self.busy = busy
        """Whether a key is being claimed or run here."""
        self.got = 0
        """Keys received from the relay of this connection."""
        self.done = 0
        """Successes recorded while the relay hands this worker its tasks."""
        self.waiting: set[str] = set()
        """Keys received and not yet claimed nor said of."""
        self.running: set[str] = set()
        """Keys received and claimed, whose success counts in ``done``."""
        self._ended: set[str] = set()
        """Keys of ``running`` not run here at the last look (gone at the next one)."""
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
        self._quiet = False
        """What is to be said is a quiet report (``look``)."""
        self._quiet_looks = 0
        """Looks in a row that found nothing on its way."""

    def connect(self, send: Callable[[dict[str, Any]], None], names: list[str]) -> None:
        """A new subscription: report through ``send`` (the relay knows ``names`` already)."""
        self._send, self._names, self._said, self.active = send, names, {}, False
        self.got = self.done = self._said_got = self._said_done = 0
        self.free = None
        self._forget_keys()

    def disconnect(self) -> None:
        self._send = None
        self.pause()

    def resume(self) -> None:
        """The relay hands this worker its tasks: say the credit, and what becomes of them."""
        self.active = True
        self.soon()

    def pause(self) -> None:
        """The worker finds work alone: nothing to say."""
        self.active, self._said, self._must = False, {}, False
        self._forget_keys()
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None

    def received(self, keys: Iterable[str]) -> None:
        """Keys arrived: their claims will show in the relay's stream; ``got`` goes with the
        next report, or at the next look if they are still waiting then."""
        for key in keys:
            self.got += 1
            self.waiting.add(key)

    # -- ClaimReports ----------------------------------------------------------------------------

    def claimed(self, key: str, claim_at: Any) -> None:
        """Nothing to say: the claim's event shows it (and that this worker is alive)."""
        if key in self.waiting:
            self.waiting.discard(key)
            self.running.add(key)

    def held(self, key: str) -> None:
        self._say("held", key)

    def succeeded(self, key: str) -> None:
        """Nothing to say: the success's event gives the relay the slot back."""
        if key in self.running:
            self.running.discard(key)
            self.done += 1

    def missed(self, key: str) -> None:
        self._say("missed", key)

    def gone(self, key: str) -> None:
        self._say("gone", key)

    def _say(self, field: str, item: Any) -> None:
        if self.active:
            self.waiting.discard(item)
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
        """At a look at the relay's lease (every few seconds): say the credit if the relay's
        count is off, and acknowledge keys that still wait for their claim. Keys whose run
        ended without a success are let go of at the second look that finds them not run."""
        ended = {k for k in self.running if not self.busy(k)}
        self.running -= ended & self._ended
        self._ended = ended
        idle = not self.running and not self.waiting
        self._quiet_looks = self._quiet_looks + 1 if idle else 0
        spoke = self.got != self._said_got or self.done != self._said_done
        if self.waiting and self.got != self._said_got:
            self.soon()
        elif spoke and self._quiet_looks >= QUIET_LOOKS:  # nothing on its way: counts agree
            self._quiet = True
            self.soon()
        else:
            self.check()

    def _forget_keys(self) -> None:
        self.waiting.clear()
        self.running.clear()
        self._ended.clear()
        self._quiet_looks = 0

    def _report(self) -> None:
        self._flush = None
        if not self.active or self._send is None:
            return
        if not (self._must or self._said or self.changed()):
            return
        self._must = False
        self.free, self._said_got, self._said_done = self.capacity(), self.got, self.done
        message: dict[str, Any] = {"free": self.free, "got": self.got, "done": self.done}
        if self._quiet and not self.running and not self.waiting:
            message["quiet"] = True
        self._quiet = False
        names = list(self.names())
        if names != self._names:
            message["names"] = self._names = names
        message.update(self._said)
        self._said = {}
        self._send(message)
