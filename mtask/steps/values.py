"""Steps decided without I/O: a value decided once (``ctx.now``, ``ctx.uuid``) and a
patch marker (``ctx.patched``, ``ctx.deprecate_patch``). Each is given back as recorded on
replay; a new one is ``pending`` in the journal, written before the next step begins."""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Callable
from typing import Any

from mtask.steps.journal import Journal
from mtask.steps.rules import aware, check_patch, to_ms


class Values:
    """A run's values decided once and patch markers, recorded in ``journal``."""

    def __init__(self, journal: Journal) -> None:
        self.journal = journal

    def value(self, prefix: str, make: Callable[[], Any]) -> Any:
        """A value decided once (``make()`` on first use), recorded as step ``prefix#n`` with
        the next write, and given back as recorded on replay."""
        journal = self.journal
        n = journal.count(f"value:{prefix}")
        index, prior = journal.begin(f"{prefix}#{n}", "value", hold=False)
        if prior is not None and prior.get("state") == "done":
            return prior.get("result")
        made = make()
        entry = journal.entry(f"{prefix}#{n}", "value", prior, journal.store.now())
        entry.update(state="done", result=made)
        journal.tried(entry, entry["started_at"], 0)
        journal.pending.append((index, entry))
        return made

    def now(self) -> dt.datetime:
        """The server's time on first use (to the millisecond, as BSON keeps it), replayed."""
        made = self.value("now", lambda: to_ms(self.journal.store.now()))
        return aware(made) if isinstance(made, dt.datetime) else made

    def uuid(self) -> uuid.UUID:
        """A random UUID on first use, replayed."""
        return uuid.UUID(str(self.value("uuid", lambda: str(uuid.uuid4()))))

    def patched(self, patch: str) -> bool:
        """``True`` where the journal has not yet gone past this place (a new run, or a resumed
        one that never ran the code here): the marker ``patch:<id>`` is recorded with the next
        write; ``False`` where an earlier run recorded another step here (it ran the old code);
        the recorded answer where the marker is."""
        journal = self.journal
        name = f"patch:{check_patch(patch)}"
        with journal.lock:
            here = journal.here(name)
            if here is not None and (here.get("name"), here.get("kind")) != (name, "patch"):
                return False
            index, prior = journal.begin(name, "patch", hold=False)
        if prior is not None:
            return bool(prior.get("result"))
        entry = journal.entry(name, "patch", None, journal.store.now())
        entry.update(state="done", result=True)
        journal.tried(entry, entry["started_at"], 0)
        journal.pending.append((index, entry))
        return True

    def deprecate_patch(self, patch: str) -> None:
        """The new code only: a marker recorded here by an earlier run is passed over (taken as
        its place); none is recorded. Once no parked task took the old branch (``mtask step
        check``), the ``patched`` call is replaced by this one, and later removed."""
        journal = self.journal
        name = f"patch:{check_patch(patch)}"
        with journal.lock:
            here = journal.here(name)
            if here is not None and (here.get("name"), here.get("kind")) == (name, "patch"):
                journal.begin(name, "patch", hold=False)
