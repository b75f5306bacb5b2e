"""The three narrow contracts of finding work.

- ``Inbox``: all a source of change events may call (``OwnStream``, the relay's stream, a
  subscriber passing on what its relay sent).
- ``QueueSink``: the worker's claim queue as the ``Claimer``, the ``LimitGate`` and the
  ``OutcomeRecorder`` see it: where tasks go back, and what is known of one.
- ``ClaimReports``: what a subscriber knows of the keys it was handed. Its claims and
  successes reach the relay through the relay's stream (their tags); a held, missed or gone
  key the relay hears from the subscriber. Only the shared stream implements it.
- ``ClaimsBack``: the worker's claims as a stream read in its own process sees them
  (``InFlight``): a mark before a change is handed over, then a wait (bounded) for the claims
  begun since. The relay alone with its worker, and an own stream, read again after the claim
  their last change led to has come back (``stream.ClaimsFirst``).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from typing import Any, Protocol

from mtask.worker.finding.placement import TaskMeta


class ClaimsBack(Protocol):
    def claims_mark(self) -> int:
        """A mark of the claims begun so far."""

    async def claims_back(self, mark: int, within: float) -> None:
        """Return once no claim begun after ``mark`` is on its way, or after ``within``
        seconds."""


class NoClaims:
    """``ClaimsBack`` of a subscriber without a claimer (tests, tools): nothing to wait for."""

    def claims_mark(self) -> int:
        return 0

    async def claims_back(self, mark: int, within: float) -> None:
        return None


class Inbox(Protocol):
    async def opened(self) -> None:
        """The stream is (re)open: scan for what came before it (or while it was closed)."""

    def on_change(self, change: Mapping[str, Any]) -> None:
        """One change event (a hint)."""

    async def settle(self) -> None:
        """After an event or a quiet wait: look up the unknown, quarantine the malformed."""

    def restarted(self) -> None:
        """The stream failed and is being reopened."""


class QueueSink(Protocol):
    def requeue_at(self, key: str, when: dt.datetime) -> None:
        """Put a known task back at ``when`` (a limit holds it back)."""

    async def requeue(self, keys: list[str], later_than: dt.datetime | None = None) -> None:
        """Put tasks back from their current documents (no event will: a claim that missed,
        an outcome that could not be written). With ``later_than``: only those not claimable
        by then (a due key a claim missed was taken by another worker)."""

    def request_rescan(self) -> None: ...

    def request_top_up(self) -> None:
        """Half of a queue that left tasks out is gone: read on (``Scanner.top_up``)."""

    def succeeded(self, key: str) -> None:
        """This worker recorded a success of ``key`` (an own stream leaves that event out; a
        relay's counts it, as the subscriber's ``Reporter`` does)."""

    def claimed(self, doc: Mapping[str, Any]) -> None:
        """This worker claimed the task of ``doc`` (an own stream leaves that event out too)."""

    def ignore(self, key: Any) -> None: ...

    def known(self, key: str) -> TaskMeta | None: ...

    def timeouts(self, keys: list[str]) -> dict[str, int]: ...


class ClaimReports(Protocol):
    def claimed(self, key: str, claim_at: Any) -> None:
        """Claimed ``key``: next claimable at ``claim_at`` (its lease's end). The claim's
        event tells the relay."""

    def held(self, key: str) -> None:
        """Keeps ``key`` for later (a cluster-wide limit holds it back)."""

    def succeeded(self, key: str) -> None: ...

    def missed(self, key: str) -> None:
        """A claim of ``key`` missed although it was due."""

    def gone(self, key: str) -> None:
        """Found ``key`` finished or deleted."""
