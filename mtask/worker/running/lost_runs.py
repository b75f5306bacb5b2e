"""A run no longer its own, as the lease pinger finds it: what it keeps, and who is told.

A ping that matches nothing means the run lost its task (taken over, cancelled, released, or
this worker no longer allowed); a limit's slot the ping finds another run's means the run must
stop while its task is still its own (``slots.extend``). Either way the executor is told, on
the event loop given to ``LeasePinger.start`` (``deliver_on``), not on the pinger's thread. A
run that holds a sequence's lock or limit slots, and whose task was only cancelled or stopped
allowing this worker, keeps its lease while its handler stops (``keeps``), so that what it holds
stays held until it has really stopped (docs/flow-control.md).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

LostCallback = Callable[[str, dict[str, Any] | None], None]
"""Called with the run id and the task's current status document (``None`` if the task is
gone): on the pinger thread, or on the event loop given to ``LeasePinger.start``."""
SlotLostCallback = Callable[[str, str], None]
"""Called, as ``LostCallback`` is, with the run id and the slot of a limit it no longer holds,
while its task is still its own (``slots.extend``)."""


class LostRuns:
    """The pinger's news of runs no longer their own, delivered on the event loop."""

    def __init__(self, on_lost: LostCallback, on_slot_lost: SlotLostCallback) -> None:
        self._on_lost = on_lost
        self._on_slot_lost = on_slot_lost
        self._loop: asyncio.AbstractEventLoop | None = None

    def deliver_on(self, loop: asyncio.AbstractEventLoop | None) -> None:
        """Call the callbacks on ``loop`` from now on (``None``: on the caller's thread)."""
        self._loop = loop

    @staticmethod
    def keeps(holds: bool, run_id: str, status: dict[str, Any] | None) -> bool:
        """Whether a run whose ping missed keeps its lease while it stops: it ``holds`` a lock
        or slots (and is not pinged as stopping already), and its task was cancelled or only
        stopped allowing this worker (its run is still RUNNING); not once taken over or
        released."""
        if not holds or status is None:
            return False
        runs = status.get("runs")
        mine = isinstance(runs, list) and any(
            isinstance(r, dict) and r.get("run_id") == run_id and r.get("state") == "RUNNING"
            for r in runs
        )
        return mine and status.get("status") in ("cancelled", "pending", "running")

    def lost(self, run_id: str, status: dict[str, Any] | None) -> None:
        """The run's task is no longer its own (``status``: its current status document)."""
        self._call_on_loop(self._on_lost, run_id, status)

    def slot_lost(self, run_id: str, slot: str) -> None:
        """Another run holds the run's place in ``slot``: it stops, its task given back."""
        self._call_on_loop(self._on_slot_lost, run_id, slot)

    def _call_on_loop(self, callback: Callable[..., None], *args: Any) -> None:
        if self._loop is None:
            callback(*args)
            return
        with contextlib.suppress(RuntimeError):  # the loop closed: the worker is gone
            self._loop.call_soon_threadsafe(callback, *args)
