"""What becomes of a signal just sent to a task (pure): which wait takes it, or why none will.

The k-th ``wait_for`` of a signal name takes the k-th signal of that name (docs/steps.md). So a
signal sent after a recorded wait already took the first one (a payload-less ``null``, say) is
not for that wait: it goes to a second ``wait_for`` of the name, if the handler ever asks for
one. The answer says so, instead of "kept", and names the step to reset to hand it to the wait
(``mtask step reset``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mtask.models import Task


NEXT_WAIT = "kept for the task's next wait for it"
"""The answer when no recorded wait of the name exists yet: the first one takes it."""


def fate(task: Task, name: str, woke: bool) -> str:
    """``task`` as read after the signal ``name`` was sent (its last signal of that name);
    ``woke``: the signal's own answer (it was waiting for it)."""
    if woke:
        return "it woke the task"
    nth = sum(1 for s in task.signals if s.name == name) - 1
    waits = [s for s in task.steps if s.kind == "signal" and s.signal == name]
    taker = next((s for s in waits if s.nth == nth), None)
    if taker is not None and taker.state == "timed_out":
        return (
            f"no wait takes it: {taker.name} timed out before it came (reset that step and it "
            "waits again)"
        )
    if taker is not None:
        return f"{taker.name} takes it"
    recorded = [s for s in waits if s.state in ("done", "timed_out")]
    if not recorded:
        return NEXT_WAIT
    last = recorded[-1]
    took = "took" if len(recorded) == 1 else "took the earlier ones"
    return (
        f"kept, but only a further wait_for({name!r}) would take it: {last.name} already "
        f"{took} (signal #{(last.nth or 0) + 1}). To hand it to {last.name}, reset that step "
        f"(mtask step reset {task.key} {last.name})"
    )
