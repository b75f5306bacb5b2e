"""Who waits for a group: the subscribers that keep a key of a group back (``held``: a
cluster-wide limit, or a sequence's lock, holds it), by the group's slot document
(``limits.group_slot``). When that document changes, or a run of the group ends for good, the
relay tells them, and no one else (a group's slot changes twice a run: every subscriber hearing
of every group would cost the wire a frame a run per host)."""

from __future__ import annotations

from mtask.limits.rules import group_slot
from mtask.worker.finding.shared.credit import Channel


class GroupWaiters:
    def __init__(self) -> None:
        self.by_slot: dict[str, set[Channel]] = {}
        """The subscribers waiting, by the group's slot document."""
        self.slot_of: dict[str, str] = {}
        """The group slot of each key a subscriber keeps, until the key's next event (the
        relay forgot the task itself, so that it is not handed out again)."""

    def held(self, key: str, group: tuple[str, str] | None, by: Channel | None) -> None:
        """``by`` keeps ``key``, of ``group`` (if the relay still knew the task)."""
        if group is not None:
            self.slot_of[key] = group_slot(*group)
        if by is not None and (slot := self.slot_of.get(key)) is not None:
            self.by_slot.setdefault(slot, set()).add(by)

    def known_again(self, key: str) -> None:
        """An event for ``key``: the relay places the task again."""
        self.slot_of.pop(key, None)

    def pop(self, slot: str) -> set[Channel]:
        """Who waits for ``slot``, told once: they wait no more."""
        return self.by_slot.pop(slot, set())

    def drop(self, channel: Channel) -> None:
        """A subscriber that went waits for nothing."""
        for slot, waiters in list(self.by_slot.items()):
            waiters.discard(channel)
            if not waiters:
                del self.by_slot[slot]
