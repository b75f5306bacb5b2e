"""Children spawned and awaited without a slot:
``results = await ctx.spawn_and_wait([Spawn("resize", {"image": i}) for i in images])``.

The spawn is a durable step of kind ``children``. Its first run records the step (``waiting``,
with ``total``) and, in the same fenced update, the parent's counter of them (``spawned``:
``step``, ``index``, ``total``, ``done``, ``failed``, ``bits``); then it publishes the children
(idempotent upserts, each key derived from the parent's key, the step's name and the child's
part: ``parent/spawn#1/0``), each holding ``parent`` and ``spawn: {parent, step, index}``; and
the run ends WAITING (``waiting.children``), freeing its slot.

Nothing polls. The worker that records a child's final outcome counts it on the parent (one
update per child, idempotent: it sets the child's bit in ``spawned.bits`` only if clear, and
increments ``done`` in the same update) and wakes the parents whose count is full, in one
update on the server's clock (``store.children``). The flow sweep recounts a parent that
waited a while without a wake (a worker that died between its child's outcome and the count),
so a lost wake-up cannot strand it. A parent's run ending WAITING after its children finished
finds the count full and is claimable at once: one of the two atomic updates sees the other.

When the task resumes, the step reads its children once (paged by the ``parent`` index), and
records their results in order (stored aside if large); a later run replays them. A child
that failed for good (failed, cancelled, invalid) makes the step ``failed`` with the children
named, and raises ``ChildFailed`` (recorded: a replay raises it again; the handler may catch
it). Cancelling the parent cancels its open children (``store.children.cancel_children``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mtask.errors import InvalidTask, MtaskError
from mtask.steps import NEVER, Doc, StepError, StepMismatch
from mtask.vocabulary import MAX_KEY_LENGTH, TaskStatus

if TYPE_CHECKING:  # the step engine: loaded by a run's steps, not by the client's store
    from mtask.steps import Journal, Plan, RunSteps

MAX_CHILDREN = 100_000
"""The most children one step spawns (their counter's bits fit the parent's document)."""
BITS = 32
"""Children per word of ``spawned.bits`` (a 64-bit integer, its low 32 bits used)."""
MAX_NAMED = 20
"""The failed children a ``ChildFailed`` and its step's entry name (all are counted)."""
FINISHED = (
    TaskStatus.SUCCEEDED.value,
    TaskStatus.FAILED.value,
    TaskStatus.CANCELLED.value,
    TaskStatus.INVALID.value,
)


@dataclass(frozen=True)
class Spawn:
    """A child to spawn: its task ``name`` and ``params``; ``key`` its own part of its key
    (default: its place, ``0``, ``1``, …; the key is ``<parent>/<step>/<key>``); ``options``
    as a publish takes them."""

    name: str
    params: Mapping[str, Any] | None = None
    key: str | None = None
    options: Mapping[str, Any] | None = None


class ChildFailed(MtaskError):
    """Children of a ``spawn_and_wait`` failed for good. ``failures``: each ``{index, key,
    name, status, error}`` (the first ``MAX_NAMED``); ``failed``: how many; ``results``: every
    child's result in order (``None`` for the failed ones)."""

    default_message = "a child task failed"

    def __init__(
        self, step: str, failures: list[Doc], failed: int, total: int, results: list[Any]
    ) -> None:
        self.step, self.failures, self.failed, self.results = step, failures, failed, results
        named = "; ".join(_said(f) for f in failures[:5])
        more = f"; and {failed - 5} more" if failed > 5 else ""
        super().__init__(f"{failed} of {total} children of step {step!r} failed: {named}{more}")


def _said(failure: Mapping[str, Any]) -> str:
    error = f": {failure['error']}" if failure.get("error") else ""
    return f"{failure.get('key')!r} ({failure.get('name')}) {failure.get('status')}{error}"


def child_key(parent: str, step: str, part: str) -> str:
    """``parent/step/part``; hashed when that would be longer than a key may be."""
    key = f"{parent}/{step}/{part}"
    if len(key) > MAX_KEY_LENGTH:
        key = f"{parent[:64]}/…{hashlib.sha256(key.encode()).hexdigest()}"
    return key


def build(parent: str, step: str, children: Iterable[Any]) -> list[Doc]:
    """The children to publish, validated: each ``{index, name, key, params, options}``.
    ``StepError`` names a bad one (the run fails for good: it would on every replay)."""
    from mtask.models import NewTask

    built: list[Doc] = []
    parts: set[str] = set()
    for index, child in enumerate(children):
        if index >= MAX_CHILDREN:
            raise StepError(f"a step spawns at most {MAX_CHILDREN} children")
        spec = _spec(index, child)
        part = str(index) if spec.key is None else spec.key
        if part in parts:
            raise StepError(f"child {index}: its key {part!r} is another child's")
        parts.add(part)
        key = child_key(parent, step, part)
        try:
            NewTask.build(spec.name, key, spec.params, spec.options)
        except InvalidTask as exc:
            raise StepError(f"child {index}: {exc.message}") from None
        built.append(
            {
                "index": index,
                "name": spec.name,
                "key": key,
                "params": dict(spec.params or {}),
                "options": dict(spec.options) if spec.options is not None else None,
            }
        )
    if not built:
        raise StepError("spawn_and_wait needs at least one child")
    return built


def _spec(index: int, child: Any) -> Spawn:
    if isinstance(child, Spawn):
        return child
    if isinstance(child, tuple) and len(child) == 2:
        return Spawn(child[0], child[1])
    if isinstance(child, tuple) and len(child) == 3:
        return Spawn(child[0], child[2], key=child[1])
    raise StepError(
        f"child {index}: a Spawn(name, params), (name, params) or (name, key, params), not "
        f"{type(child).__name__}"
    )


def word_bit(index: int) -> tuple[int, int]:
    """Which word of ``spawned.bits`` holds child ``index``'s bit, and which bit."""
    return divmod(index, BITS)


def words(total: int) -> int:
    return (total + BITS - 1) // BITS


def spawn_plan(
    steps: RunSteps, parent: str, children: Iterable[Any], name: str | None
) -> Plan[list[Any]]:
    """The step (see the module's docstring), recorded in the run's journal: spawn, wait, then
    the results."""
    from mtask.steps import Io, Suspended, Wait

    journal = steps.journal
    if journal.group() is not None:
        raise StepError("spawn_and_wait is not a branch of a gather: spawn every child at once")
    n = journal.count("spawn")
    step = name if name is not None else f"spawn#{n}"
    specs = build(parent, step, children)
    index, prior = journal.begin(step, "children")
    if prior is not None and prior.get("state") in ("done", "failed"):
        return (yield from _replayed(journal, step, prior))
    entry = journal.entry(step, "children", prior, journal.store.now())
    entry["total"] = len(specs)
    tag = _tag(prior, step)
    if prior is None:  # a spawn of this step's name before (a retry, a reset): new children
        earlier: list[Doc] = yield Io(lambda: journal.store.children(step))
        if earlier:
            tag = entry["tag"] = generation(step, journal.run_id)
            specs = build(parent, tag, children)
    waiting = Suspended(Wait(index, None, NEVER, children=tag))
    linked(specs)
    if prior is None:
        entry["state"] = "waiting"
        yield Io(lambda: journal.store.spawn(index, entry, specs))
        journal.keep(index, entry)
        raise waiting
    if prior.get("total") != len(specs):
        raise StepMismatch(
            f"step {step!r} spawned {prior.get('total')} children; this run asks for "
            f"{len(specs)}: the children must be the recorded ones"
        )
    if tag != step:
        specs = linked(build(parent, tag, children))
    found: list[Doc] = yield Io(lambda: journal.store.children(tag))
    if len(found) < len(specs):  # the run that spawned them died before it published all
        yield Io(lambda: journal.store.publish(tag, specs))
    if len(found) < len(specs) or any(c.get("status") not in FINISHED for c in found):
        raise waiting  # woken early (a sweep, a takeover): the count decides again
    return (yield from _finished(journal, index, entry, prior, found))


def linked(specs: list[Doc]) -> list[Doc]:
    """``specs``, each holding the spawning step's trace context (``trace``), where its span
    is: the children's runs join its trace, linked to it (``mtask.tracing``)."""
    from mtask.steps.spans import carrier

    context = carrier()
    if context:
        for spec in specs:
            spec["trace"] = context
    return specs


def generation(step: str, run_id: str) -> str:
    """The tag of a spawn of step ``step`` recorded anew by run ``run_id`` while children of an
    earlier spawn of that name exist (the task was retried or reset): its children's keys,
    ``spawn.step`` and its counter's ``step`` carry it, so that none of the earlier children
    is taken for one of these (``step@<run>``)."""
    return f"{step}@{run_id.replace('-', '')[:12]}"


def _tag(prior: Mapping[str, Any] | None, step: str) -> str:
    """The tag a recorded spawn's children carry: the step's name, or its generation's."""
    tag = (prior or {}).get("tag")
    return tag if isinstance(tag, str) and tag else step


def _finished(
    journal: Journal, index: int, entry: Doc, prior: Doc, found: list[Doc]
) -> Plan[list[Any]]:
    """Every child finished: record their results (or the failures) once."""
    results = [c.get("result") if c.get("status") == TaskStatus.SUCCEEDED.value else None
               for c in found]  # fmt: skip
    failures = [_failure(c) for c in found if c.get("status") != TaskStatus.SUCCEEDED.value]
    now = journal.store.now()
    error = None
    if failures:
        error = str(ChildFailed(entry["name"], failures, len(failures), len(found), results))
        entry.update(
            state="failed", error=error, failed=len(failures), failures=failures[:MAX_NAMED]
        )
    else:
        entry["state"] = "done"
    journal.tried(entry, now, 0, error)
    yield from journal.put_result(entry, results)
    yield from journal.write(index, entry, prior)
    if failures:
        raise ChildFailed(entry["name"], failures[:MAX_NAMED], len(failures), len(found), results)
    return results


def _replayed(journal: Journal, step: str, prior: Doc) -> Plan[list[Any]]:
    """A recorded outcome of the children: their results, or ``ChildFailed`` again."""
    results = yield from journal.read(prior)
    if prior.get("state") == "done":
        return list(results or [])
    failures = [f for f in prior.get("failures") or [] if isinstance(f, dict)]
    failed = prior.get("failed")
    count = failed if isinstance(failed, int) else len(failures)
    total = prior.get("total")
    if not isinstance(total, int):
        total = len(results or [])
    raise ChildFailed(step, failures, count, total, list(results or []))


def _failure(child: Mapping[str, Any]) -> Doc:
    error = child.get("error")
    line = (str(error).strip().splitlines() or [""])[-1] if error else ""
    return {
        "index": child.get("index"),
        "key": child.get("key"),
        "name": child.get("name"),
        "status": child.get("status"),
        "error": line[:500],
    }
