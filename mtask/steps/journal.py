"""A run's journal (docs/steps.md): the entries earlier runs recorded (from the claimed
document); where each step asked for goes and what is recorded there (``begin``: the replay
rules); the names steps are given (a loop's are numbered); and how an entry is made, kept and
written (plans of ``Io``: no I/O here).

A run asks for its steps in the recorded order: the n-th step asked is the n-th recorded, same
name and kind (a ``ctx.gather``'s steps are one place, matched among themselves by name:
``mtask.steps.gather``), else ``StepMismatch``. One step runs at a time (``one``); the entries
decided without I/O (``pending``) are written before the next step begins (``flush``).
"""

from __future__ import annotations

import datetime as dt
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from mtask.steps.gather import CURRENT, Group
from mtask.steps.plan import Io, Plan
from mtask.steps.rules import (
    INLINE_BYTES,
    INLINE_TOTAL_BYTES,
    MAX_SPILL_BYTES,
    MAX_STEPS,
    MAX_TRIES_KEPT,
    Doc,
    StepError,
    StepMismatch,
    check_name,
    decode,
    encode,
    replays,
)
from mtask.steps.spans import OPEN
from mtask.vocabulary import storable_depth

if TYPE_CHECKING:
    from mtask.steps.spans import StepSpans
    from mtask.steps.stores import StepStore

T = TypeVar("T")


def caller(depth: int = 2) -> Any:
    """Where in the handler a step is asked for: the code and instruction of the frame
    ``depth`` levels up (the caller of the function that calls this)."""
    frame = sys._getframe(depth)
    return (frame.f_code, frame.f_lasti)


class Journal:
    """One run's entries: ``recorded`` is the claimed document's ``steps``, written through
    ``store`` by run ``run_id`` (the task's attempt ``attempt``); ``frontier`` is called with
    each step asked for that the journal does not replay (``mtask.steps.preflight`` stops its dry
    replay there; ``None``: nothing); ``spans`` is told of each step begun, replayed or run,
    and of its end (``mtask.steps.spans``; ``None``: no tracer, nothing is asked)."""

    def __init__(
        self,
        store: StepStore,
        recorded: Any,
        *,
        run_id: str,
        attempt: int,
        frontier: Callable[[int, str, str, Doc | None], None] | None = None,
        spans: StepSpans | None = None,
    ) -> None:
        self.store = store
        self.spans = spans
        self.recorded: list[Doc] = [
            dict(e) for e in (recorded if isinstance(recorded, list) else []) if isinstance(e, dict)
        ]
        self.run_id = run_id
        self.attempt = attempt
        self.frontier = frontier
        self.asked: list[str] = []
        self.inside: str | None = None
        """The step whose function is running (another is refused meanwhile)."""
        self.spilled = False
        """Whether this run stored a result aside (its task's retention seals it)."""
        self.inline = sum(len(encode(e["result"])) for e in self.recorded if "result" in e)
        """The bytes of the inline results recorded so far."""
        self.sites: dict[str, Any] = {}
        """Where in the handler each name was first asked for: asked again from there (a
        loop), it is numbered (``fetch#2``)."""
        self.repeats: dict[str, int] = {}
        self.counts: dict[str, int] = {}
        """How many of each unnamed kind were asked for (``count``)."""
        self.pending: list[tuple[int, Doc]] = []
        """Entries decided without I/O (``patched``, ``now``, ``uuid``), written before the
        next step begins."""
        self.lock = threading.RLock()
        """``ctx.gather_sync`` begins steps from several threads."""

    # -- where the next step goes ---------------------------------------------------------------

    def begin(self, name: str, kind: str, *, hold: bool = True) -> tuple[int, Doc | None]:
        """The place of the next step asked for and what is recorded there (``None``: nothing).
        ``hold``: the step runs until its plan ends (``one``), and no other may begin
        meanwhile; a step decided at once (``patched``, ``now``) holds nothing."""
        check_name(name)
        with self.lock:
            group = self.group()
            if group is not None:
                index, prior = group.begin(name, kind)
            else:
                index, prior = self._begin_alone(name, kind, hold)
        if self.frontier is not None and not replays(prior):
            self.frontier(index, name, kind, prior)
        if self.spans is not None and hold:  # its span, current until its plan ends (``one``)
            label = group.label if group is not None else None
            OPEN.set(self.spans.step(name, kind, replays(prior), label))
        return index, prior

    def _begin_alone(self, name: str, kind: str, hold: bool) -> tuple[int, Doc | None]:
        if self.inside is not None:
            raise StepError(
                f"step {name!r} was asked for while step {self.inside!r} runs: one step at a "
                "time (steps do not nest or run concurrently; their order is the record's)"
            )
        self.check_new(name)
        index = len(self.asked)
        prior = self.recorded[index] if index < len(self.recorded) else None
        if prior is not None and (prior.get("name") != name or prior.get("kind") != kind):
            raise StepMismatch(
                f"step {index + 1} is recorded as {prior.get('name')!r} ({prior.get('kind')}); "
                f"this run asked for {name!r} ({kind}) there: the steps must be asked for in "
                "the recorded order"
            )
        self.asked.append(name)
        if hold:
            self.inside = name  # until its plan ends (``one``)
        return index, prior

    def replaying(self) -> bool:
        """Whether an earlier run recorded steps past the ones this run asked for so far (so
        it went past this point of the handler)."""
        return len(self.asked) < len(self.recorded)

    def check_new(self, name: str) -> None:
        if name in self.asked:
            raise StepError(f"step {name!r} was asked for twice: step names are unique in a task")
        if len(self.asked) >= MAX_STEPS:
            raise StepError(
                f"a task records at most {MAX_STEPS} steps (a loop without end continues as "
                "new: ctx.continue_as_new)"
            )

    def group(self) -> Group | None:
        """The ``ctx.gather`` this context's steps belong to, if any."""
        group = CURRENT.get()
        return group if group is not None and group.journal is self else None

    def here(self, name: str) -> Doc | None:
        """What the journal recorded where the next step goes: in a group, the entry of this
        name, or any of the group's (it ran the old code) if none has it."""
        group = self.group()
        if group is not None:
            found = group.recorded.get(name)
            if found is None and group.span:
                return next(iter(group.recorded.values()))
            return found
        index = len(self.asked)
        return self.recorded[index] if index < len(self.recorded) else None

    def one(self, plan: Plan[T]) -> Plan[T]:
        """``plan``, after which another step may begin (one at a time: ``begin``); the entries
        decided without I/O before it are written first (``pending``)."""
        yield from self.flush()
        asked = len(self.asked)
        before = OPEN.get() if self.spans is not None else None
        error: BaseException | None = None
        try:
            value = yield from plan
        except BaseException as exc:
            error = exc
            raise
        finally:
            # it began (a refused one leaves the running one be); a group's steps leave the
            # group's hold to the group
            if len(self.asked) > asked and self.group() is None:
                self.inside = None
            if self.spans is not None:
                self.span_ended(before, error)
        return value

    def span_ended(self, before: Any, error: BaseException | None) -> None:
        """The span the step begun here opened (if any: ``before`` was current) is closed,
        ``error`` its end (a ``Suspended``: the run ends waiting there)."""
        opened = OPEN.get()
        if opened is not None and opened is not before:
            OPEN.set(before)
            opened.close(error)

    # -- names ----------------------------------------------------------------------------------

    def numbered(self, name: str, site: Any) -> str:
        """``name``, or ``name#2``, ``name#3``, … when it is asked for again from the same place
        in the handler (a loop, or a helper called in one). Asked for again from another place,
        it stays ``name``, which ``begin`` refuses: two different steps that share a name."""
        if site is None or not isinstance(name, str):
            return name
        with self.lock:
            first = self.sites.get(name)
            if first is None:
                self.sites[name], self.repeats[name] = site, 1
                return name
            if first != site:
                return name
            n = self.repeats[name] = self.repeats[name] + 1
        return f"{name}#{n}"

    def count(self, what: str) -> int:
        """How many times ``what`` was asked for, this one included (``sleep``, ``gather``,
        ``spawn``, ``signal:<name>``, ``until:<collection>``, ``value:<prefix>``): an unnamed
        step's number (``sleep#2``), a wait's place among those of its signal."""
        with self.lock:
            n = self.counts[what] = self.counts.get(what, 0) + 1
        return n

    # -- entries --------------------------------------------------------------------------------

    def entry(self, name: str, kind: str, prior: Doc | None, now: dt.datetime) -> Doc:
        entry: Doc = {
            "name": name,
            "kind": kind,
            "attempts": int((prior or {}).get("attempts") or 0),
            "run_id": self.run_id,
            "attempt": self.attempt,
            "started_at": (prior or {}).get("started_at") or now,
        }
        for kept in ("until", "signal", "nth", "collection", "tries", "tag"):
            if prior is not None and kept in prior:
                entry[kept] = prior[kept]
        group = self.group()
        if group is not None:
            entry["group"] = group.label
        return entry

    def tried(self, entry: Doc, now: dt.datetime, ms: int, error: str | None = None) -> None:
        tried: Doc = {"run_id": self.run_id, "attempt": self.attempt, "at": now, "ms": ms}
        if error is not None:
            tried["error"] = error
        tries = [t for t in entry.get("tries") or [] if isinstance(t, dict)]
        entry["tries"] = [*tries, tried][-MAX_TRIES_KEPT:]
        entry["attempts"] = int(entry.get("attempts") or 0) + 1
        entry["finished_at"] = now
        entry["ms"] = ms

    def store_result(self, entry: Doc, result: Any) -> bytes | None:
        """Put ``result`` in ``entry`` if it is small and shallow; else return its encoding,
        to spill."""
        data = encode(result)
        if len(data) > MAX_SPILL_BYTES:
            raise StepError(f"a step's result is {len(data)} bytes; at most {MAX_SPILL_BYTES}")
        if (
            len(data) <= INLINE_BYTES
            and self.inline + len(data) <= INLINE_TOTAL_BYTES
            and storable_depth(result, len(data))  # MongoDB refuses a deeper one's record
        ):
            entry["result"] = result
            self.inline += len(data)
            return None
        return data

    def put_result(self, entry: Doc, result: Any) -> Plan[None]:
        """``result`` in ``entry``: inline (``store_result``), else stored aside first and
        referred to (``spill``)."""
        data = self.store_result(entry, result)
        if data is not None:
            entry["spill"] = yield Io(lambda: self.store.spill(data))
            self.spilled = True

    def read(self, prior: Doc) -> Plan[Any]:
        spill = prior.get("spill")
        if isinstance(spill, dict):
            data = yield Io(lambda: self.store.load(spill))
            return decode(data)
        return prior.get("result")

    def keep(self, index: int, entry: Doc) -> None:
        if index < len(self.recorded):
            self.recorded[index] = entry
        else:
            self.recorded.append(entry)

    def keep_named(self, entry: Doc) -> None:
        for i, kept in enumerate(self.recorded):
            if kept.get("name") == entry["name"]:
                self.recorded[i] = entry
                return
        self.recorded.append(entry)

    def write(self, index: int, entry: Doc, prior: Doc | None) -> Plan[None]:
        if "group" in entry:  # a parallel step: by its name, wherever it ends (``Group``)
            yield Io(lambda: self.store.record_named(entry, prior))
            with self.lock:
                self.keep_named(entry)
            return
        yield Io(lambda: self.store.record(index, entry, prior))
        self.keep(index, entry)

    def flush(self) -> Plan[None]:
        """Write the entries decided without I/O, in order (``pending``)."""
        while self.pending:
            index, entry = self.pending.pop(0)
            yield from self.write(index, entry, None)
