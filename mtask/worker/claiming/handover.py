"""A lock's slot handed from an ended run of this worker to a key of it that waits for the slot
(``Handovers``), ``releases.SlotReleases``' book of them (pure: no I/O).

When a run ends, its slot in a group limited only by runs at once (a lock) is given back once
its outcome is written. If a key of this worker waits for that slot, the slot is kept instead:
the key goes back in the claim queue, and its take replaces the ended run in the same write
(``slots.Request.replaces``: one write instead of a release and a take, and no event). A kept
place the claimer did not use in its next pass is given back (``unused``); a run's place is
kept once, and given back the next time (``offered``).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Handovers:
    kept: dict[str, list[tuple[str, float]]] = field(default_factory=dict)
    """Per lock slot, this worker's ended runs that still hold it, each with the monotonic
    time it was kept."""
    offered: set[str] = field(default_factory=set)
    """Run ids kept once: given back without being kept again."""

    def keep(self, slot: str, run_ids: list[str], waiting: int, at: float) -> list[str]:
        """Keep as many of ``run_ids``' places in ``slot`` as keys wait for it (``waiting``),
        at ``at``; returns the run ids to give back (those not kept, and those kept once
        before)."""
        again = [r for r in run_ids if r in self.offered]  # unused once: given back now
        self.offered.difference_update(again)
        fresh = [r for r in run_ids if r not in again]
        kept = fresh[:waiting]
        if kept:
            self.kept.setdefault(slot, []).extend((run_id, at) for run_id in kept)
            self.offered.update(kept)
        return fresh[len(kept) :] + again

    def take(self, slot: str) -> str | None:
        """The run id of a kept place in ``slot``, handed over now (``None``: none kept)."""
        kept = self.kept.get(slot)
        if not kept:
            return None
        run_id, _ = kept.pop(0)
        self.offered.discard(run_id)
        if not kept:
            del self.kept[slot]
        return run_id

    def refused(self, run_id: str) -> None:
        """The take that ``run_id``'s place was handed over to was refused (the slot holds more
        runs than its limit allows: a limit lowered): its place is given back, never kept again
        (kept again for the key the refusal blocks, it went round for good, the group stalled
        until the ended run's lease ran out)."""
        self.offered.add(run_id)

    def unused(self, before: float) -> dict[str, list[str]]:
        """Remove and return the places kept before ``before`` (monotonic)."""
        out: dict[str, list[str]] = {}
        for slot in list(self.kept):
            kept = self.kept[slot]
            old = [r for r, at in kept if at < before]
            if old:
                out[slot] = old
                kept[:] = [(r, at) for r, at in kept if at >= before]
                if not kept:
                    del self.kept[slot]
        return out

    def forget(self) -> dict[str, list[str]]:
        """Every place kept, removed (to give back): the worker is stopping."""
        self.offered.clear()
        return self.unused(float("inf"))
