"""What a dispatched worker tells its relay (``ClaimReports``, and its credit), batched.

Everything said in one turn of the event loop goes in one report: ``free`` and ``got`` (the
credit), ``names`` when they changed, and what became of handed keys. A reporter is connected
to one subscription (``got`` counts the keys received on it, as the relay counts the keys it
sent on it), and says something only while it is active: from the relay's ``open`` until the
worker finds work alone again (keys it claims then are not the relay's business: its stream
sees them).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any


class Reporter:
    def __init__(self, capacity: Callable[[], int], names: Callable[[], Sequence[str]]) -> None:
        self.capacity = capacity
        self.names = names
        self.got = 0
        """Keys received from the relay of this connection."""
        self.free: int | None = None
        """The ``free`` last said."""
        self._send: Callable[[dict[str, Any]], None] | None = None
        self.active = False
        self._said_got = 0
        self._said: dict[str, list[Any]] = {}
        self._names: list[str] | None = None
        self._flush: asyncio.Handle | None = None

    def connect(self, send: Callable[[dict[str, Any]], None], names: list[str]) -> None:
        """A new subscription: report through ``send`` (the relay knows ``names`` already)."""
        self._send, self.got, self._names, self._said, self.active = send, 0, names, {}, False
        self._said_got = 0

    def disconnect(self) -> None:
        self._send = None
        self.pause()

    def resume(self) -> None:
        """The relay hands this worker its tasks: say the credit, and what becomes of them."""
        self.active = True
        self.soon()

    def pause(self) -> None:
        """The worker finds work alone: nothing to say."""
        self.active, self._said = False, {}
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None

    def received(self, count: int) -> None:
        """Keys arrived: ``got`` goes with the next report (their claim follows within one
        round trip, and says it: an insert saved per handed batch); the lease watch says it
        within ``LOOK_EVERY`` if nothing else does."""
        self.got += count

    # -- ClaimReports ----------------------------------------------------------------------------

    def claimed(self, key: str, claim_at: Any) -> None:
        self._say("claimed", [key, claim_at])

    def held(self, key: str) -> None:
        self._say("held", key)

    def succeeded(self, key: str) -> None:
        self._say("done", key)

    def missed(self, key: str) -> None:
        self._say("missed", key)

    def gone(self, key: str) -> None:
        self._say("gone", key)

    def _say(self, field: str, item: Any) -> None:
        if self.active:
            self._said.setdefault(field, []).append(item)
            self.soon()

    def soon(self) -> None:
        """Report once this turn of the event loop is over (one frame for all of it)."""
        if self.active and self._send is not None and self._flush is None:
            self._flush = asyncio.get_running_loop().call_soon(self._report)

    def changed(self) -> bool:
        """Whether the credit changed since it was last said."""
        return max(0, self.capacity()) != self.free or self.got != self._said_got

    def _report(self) -> None:
        self._flush = None
        if not self.active or self._send is None:
            return
        self.free, self._said_got = max(0, self.capacity()), self.got
        message: dict[str, Any] = {"free": self.free, "got": self.got}
        names = list(self.names())
        if names != self._names:
            message["names"] = self._names = names
        message.update(self._said)
        self._said = {}
        self._send(message)
