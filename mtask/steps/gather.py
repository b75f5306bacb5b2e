"""Parallel steps' place in the journal (``mtask.steps.parallel`` runs the branches): the
steps begun in one ``ctx.gather`` are one place in the task's order, matched among themselves by
name, in any order, and recorded by name as each ends (``StepStore.record_named``)."""

from __future__ import annotations

import contextvars
import threading
from dataclasses import dataclass, field
from typing import Protocol

from mtask.steps.plan import IN_STEP
from mtask.steps.rules import Doc, StepError, StepMismatch, check_name


class Journal(Protocol):
    """What a gather reads and marks of the run's journal (``mtask.steps.journal.Journal``)."""

    lock: threading.RLock
    recorded: list[Doc]
    asked: list[str]
    inside: str | None

    def check_new(self, name: str) -> None: ...

    def count(self, what: str) -> int: ...


@dataclass
class Group:
    """The steps begun in one ``ctx.gather`` (``mtask.steps.parallel``): its ``label``
    (``gather#n``), where it begins in the journal (``start``), the entries earlier runs recorded
    for it (the ``span`` entries from ``start`` whose ``group`` is its label), by name."""

    journal: Journal
    label: str
    start: int
    recorded: dict[str, Doc]
    span: int
    asked: list[str] = field(default_factory=list)

    def begin(self, name: str, kind: str) -> tuple[int, Doc | None]:
        """Where step ``name`` of this group is (recorded or new) and what was recorded."""
        journal = self.journal
        inside = IN_STEP.get()
        if inside is not None:
            raise StepError(
                f"step {name!r} was asked for while step {inside!r} runs: one step at a time "
                "in each branch of a gather (steps do not nest)"
            )
        journal.check_new(name)
        prior = self.recorded.get(name)
        if prior is not None and prior.get("kind") != kind:
            raise StepMismatch(
                f"step {name!r} of {self.label!r} is recorded as {prior.get('kind')}; this run "
                f"asked for it as {kind}"
            )
        later = [
            e for e in journal.recorded[self.start + self.span :] if e.get("group") != self.label
        ]
        if prior is None and later:
            raise StepMismatch(
                f"{self.label!r} is recorded without step {name!r} (the next recorded step is "
                f"{later[0].get('name')!r}): the steps must be asked for as recorded"
            )
        index = next(
            (i for i, e in enumerate(journal.recorded) if e.get("name") == name),
            len(journal.recorded),
        )
        journal.asked.append(name)
        self.asked.append(name)
        return index, prior


CURRENT: contextvars.ContextVar[Group | None] = contextvars.ContextVar("mtask_group", default=None)
"""The gather whose branch runs in this context (its tasks and threads copy it)."""


def open_group(journal: Journal, name: str | None) -> Group:
    """A ``ctx.gather`` begins: its steps are matched by name, recorded as they end."""
    with journal.lock:
        if journal.inside is not None:
            raise StepError(
                f"a gather was begun while step {journal.inside!r} runs: one step (or one "
                "gather) at a time"
            )
        n = journal.count("gather")
        label = check_name(name) if name is not None else f"gather#{n}"
        start = len(journal.asked)
        span = 0
        while (
            start + span < len(journal.recorded)
            and journal.recorded[start + span].get("group") == label
        ):
            span += 1
        mine = {str(e.get("name")): e for e in journal.recorded[start : start + span]}
        group = Group(journal, label, start, mine, span)
        journal.inside = label  # no step outside the group meanwhile
        return group


def close_group(journal: Journal, group: Group, completed: bool) -> None:
    """The gather ended (``completed``: every step of it returned)."""
    with journal.lock:
        journal.inside = None
    missing = [n for n in group.recorded if n not in group.asked]
    if completed and missing:
        raise StepMismatch(
            f"gather {group.label!r} recorded step(s) {', '.join(map(repr, missing))} that "
            "this run did not ask for: the steps must be asked for as recorded"
        )
