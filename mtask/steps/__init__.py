"""Durable steps (docs/steps.md): a handler's steps recorded in its task document, replayed by
later runs of the task instead of being called again; sleeps and signal waits that end the run
and resume it on the server's clock.

``RunSteps`` (``run``) is one run's steps, composed of named parts, each passed what it uses:

- ``journal``: the entries earlier runs recorded, where each step asked for goes and what is
  recorded there (the replay rules), the steps' names, how an entry is made and written;
- ``groups``: a ``ctx.gather``'s steps, one place in the order, matched by name (``Group``);
- the kinds of step, each a plan recording in the journal: ``calls`` (``ctx.step``, with its
  own policy: ``tries``), ``waits`` (``sleep``, ``wait_for``, ``wait_until``: ``Suspended``),
  ``values`` (``ctx.now``, ``ctx.uuid``, patch markers); children are ``mtask.steps.children``'s
  plan;
- ``runner``: how a plan is run (``plan``: it yields what it needs done, ``Io`` through the
  ``StepStore``, ``Invoke`` of the user's function), on the worker's loop or on a thread;
- ``rules`` (limits, names, errors, BSON results) and ``stores`` (the ``StepStore`` protocol,
  and ``MemorySteps``, for tests).

No I/O here: the ``StepStore`` is the worker's (``worker/running/step_stores.py``), a child
process's pipe to it (``worker/running/pool/child_steps.py``), or memory (``MemorySteps``).

Replay rules: step names are unique in a task (a name asked again from the same place in the
handler, a loop, is numbered: ``fetch#2``); a run asks for its steps in the recorded order
(the n-th step asked is the n-th recorded, same name and kind; a ``ctx.gather``'s steps are one
place, matched among themselves by name: ``Group``), else ``StepMismatch`` and the run fails
for good with nothing written. A step recorded ``done`` returns its result; one
recorded ``failed`` is called again (its attempts and errors kept); a ``sleep`` recorded with
its ``until`` is over once the server's clock passes it; a ``wait_for`` is over once its signal
is there (the k-th wait for a signal name takes the k-th signal of that name) or its timeout
passed (``SignalTimeout``, recorded, so a replay raises it again); a ``wait_until`` is over
once a ``find`` with its predicate returns the document (MongoDB decides, at the wait and at
each wake-up) or its timeout passed (``ConditionTimeout``, recorded likewise).

Workflows add, each through the same ``StepStore``: parallel steps (``Group``, recorded by
name: ``StepStore.record_named``; ``mtask.steps.parallel`` runs the branches); a step's own policy
(``mtask.steps.policy``: ``Pause`` between tries, ``StepTimeout``); values decided once and
patch markers (``value``, ``patched``: entries decided without I/O, ``pending`` until the next
step); what a step's function says held until its record (``mtask.follow.output.holding``); children
(``mtask.steps.children``'s plan, run here with ``run_plan``); and a ``frontier`` where a dry replay
stops (``mtask.steps.preflight``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mtask._version import lazy_exports
from mtask.steps.rules import (
    INLINE_BYTES,
    INLINE_TOTAL_BYTES,
    KINDS,
    MAX_SPILL_BYTES,
    MAX_STEP_NAME,
    MAX_STEPS,
    MAX_TRIES_KEPT,
    NEVER,
    SPILL_CHUNK_BYTES,
    STATES,
    ConditionTimeout,
    Doc,
    SignalTimeout,
    StepError,
    StepMismatch,
    check_name,
    check_patch,
    check_signal_name,
    decode,
    encode,
)

if TYPE_CHECKING:
    from mtask.steps.calls import Calls
    from mtask.steps.gather import CURRENT, Group, close_group, open_group
    from mtask.steps.journal import Journal, caller
    from mtask.steps.plan import IN_STEP, Invoke, Io, Pause, Plan
    from mtask.steps.run import RunSteps
    from mtask.steps.runner import Runner, complete_now
    from mtask.steps.stores import MemorySteps, StepStore
    from mtask.steps.values import Values
    from mtask.steps.waits import MAX_WAIT_IDS, REFUSED_OPERATORS, Suspended, Wait, Waits, wait_ids

# The engine's parts, imported on first use of one of their names (``rules`` above is what a
# reader of stored steps needs: ``mtask get`` loads no engine; its start-up).
_WHERE = {
    "mtask.steps.calls": ("Calls",),
    "mtask.steps.gather": ("CURRENT", "Group", "close_group", "open_group"),
    "mtask.steps.journal": ("Journal", "caller"),
    "mtask.steps.plan": ("IN_STEP", "Plan", "Invoke", "Io", "Pause"),
    "mtask.steps.run": ("RunSteps",),
    "mtask.steps.runner": ("Runner", "complete_now"),
    "mtask.steps.stores": ("MemorySteps", "StepStore"),
    "mtask.steps.values": ("Values",),
    "mtask.steps.waits": (
        "MAX_WAIT_IDS",
        "REFUSED_OPERATORS",
        "Suspended",
        "Wait",
        "Waits",
        "wait_ids",
    ),
}
__getattr__, __dir__ = lazy_exports("mtask.steps", _WHERE, globals())


__all__ = [
    "CURRENT",
    "INLINE_BYTES",
    "INLINE_TOTAL_BYTES",
    "IN_STEP",
    "KINDS",
    "MAX_SPILL_BYTES",
    "MAX_STEPS",
    "MAX_STEP_NAME",
    "MAX_TRIES_KEPT",
    "MAX_WAIT_IDS",
    "NEVER",
    "REFUSED_OPERATORS",
    "SPILL_CHUNK_BYTES",
    "STATES",
    "Calls",
    "ConditionTimeout",
    "Doc",
    "Group",
    "Invoke",
    "Io",
    "Journal",
    "MemorySteps",
    "Pause",
    "Plan",
    "RunSteps",
    "Runner",
    "SignalTimeout",
    "StepError",
    "StepMismatch",
    "StepStore",
    "Suspended",
    "Values",
    "Wait",
    "Waits",
    "caller",
    "check_name",
    "check_patch",
    "check_signal_name",
    "close_group",
    "complete_now",
    "decode",
    "encode",
    "open_group",
    "wait_ids",
]
