"""The execution graph of one task, as the dashboard's task page draws it: a pure function from
the task (``Task``, the typed view of its document) and the children read with it, to a small
tree of frozen dataclasses the template renders without deciding anything.

What it holds, in the journal's order: each durable step a node (its kind, state, attempts and
failed tries, how long it ran, slept or waited, the run and attempt that recorded it); the steps
of one ``ctx.gather`` (consecutive entries with the same ``group``) one stage whose nodes stand
side by side; a ``children`` step's children as nodes of their own (derived state, a link, the
error of a failed one), those not read named by the step's count; the runs of the task in
order; the journals it left when it continued as new; and its end (succeeded, failed in a step
or outside one, still open). Whatever the document holds (a field missing, dates without a
time zone, a group split in two, a child of no step), ``build`` returns a graph: it never
raises for a document's shape.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass

from mtask.explain.states import last_line
from mtask.models import Run, Step, Task
from mtask.vocabulary import TaskStatus

RETRIABLE = (TaskStatus.FAILED, TaskStatus.CANCELLED)
"""The statuses a task is retried from a step in (``client.retry(key, from_step=…)``)."""
WAITS = ("sleep", "signal", "data", "children")
"""The kinds of step during which the task waits, not runs."""
NEVER_YEAR = 9999
"""A wait without a deadline is stored until 9999-01-01."""


@dataclass(frozen=True)
class Try:
    """A failed call of a step: when, how long, by which run and attempt, its error's line."""

    at: dt.datetime
    seconds: float
    run: str
    attempt: int | None
    error: str


@dataclass(frozen=True)
class Child:
    """A child task: its key (its page's link), name, derived state, its took and error."""

    key: str
    name: str
    state: str
    seconds: float | None
    error: str


@dataclass(frozen=True)
class Node:
    """One durable step. ``seconds``: how long it ran (a call), slept or waited; ``so_far``:
    it still waits, counted to now. ``failed``: the step failed (a call out of tries, a child
    that failed for good); ``ended_task``: its failure is the one the task ended with."""

    place: int
    name: str
    kind: str
    state: str
    seconds: float | None
    so_far: bool
    attempts: int
    tries: tuple[Try, ...]
    detail: str
    error: str
    run: str
    attempt: int | None
    failed: bool
    ended_task: bool
    retry_from: bool
    children: tuple[Child, ...]
    children_more: int

    @property
    def waits(self) -> bool:
        return self.kind in WAITS


@dataclass(frozen=True)
class Stage:
    """One place in the task's order: a step, or a gather's steps (``group``), side by side."""

    nodes: tuple[Node, ...]
    group: str | None


@dataclass(frozen=True)
class RunNode:
    """One run of the task: its state, worker, how long and its error's line."""

    run: str
    worker: str
    state: str
    attempt: int | None
    seconds: float | None
    so_far: bool
    error: str


@dataclass(frozen=True)
class Earlier:
    """A journal the task left when it continued as new: which, its steps, last one, when."""

    n: int
    steps: int
    last: str
    at: dt.datetime


@dataclass(frozen=True)
class End:
    """How the graph ends: the task's derived ``state``; ``outside``: it failed with no
    failed step (its handler raised between steps, or a run's time ran out); ``error``: the
    line of its error, unless a failed step shows it; ``at``: when it finished."""

    state: str
    error: str
    outside: bool
    at: dt.datetime | None


@dataclass(frozen=True)
class Graph:
    stages: tuple[Stage, ...]
    runs: tuple[RunNode, ...]
    runs_folded: int
    earlier: tuple[Earlier, ...]
    continued: int
    end: End
    retriable: bool
    """The task may be retried from one of its steps (failed or cancelled, no run RUNNING)."""

    @property
    def steps(self) -> int:
        return sum(len(s.nodes) for s in self.stages)

    @property
    def parallel(self) -> int:
        return sum(1 for s in self.stages if len(s.nodes) > 1)


def build(task: Task, children: Sequence[tuple[Task, str]], state: str, now: dt.datetime) -> Graph:
    """The graph of ``task`` (derived state ``state``) at ``now`` (the server's time), with
    its ``children`` read so far, each with its derived state."""
    retriable = task.status in RETRIABLE and not any(r.state == "RUNNING" for r in task.runs)
    failed_at = _failed_at(task)
    by_step: dict[str, list[Child]] = {}
    for kid, kid_state in children:
        spawned_by = kid.spawn.step if kid.spawn is not None else ""
        by_step.setdefault(spawned_by, []).append(_child(kid, kid_state))
    attempts = {s.run_id: s.attempt for s in task.steps if s.attempt is not None}
    waits = task.waiting is not None and task.status is TaskStatus.PENDING
    current = task.waiting.index + 1 if task.waiting is not None and waits else None
    stages: list[Stage] = []
    for place, step in enumerate(task.steps, 1):
        node = _node(place, step, now, by_step, retriable, place == failed_at, place == current)
        last = stages[-1] if stages else None
        if step.group and last is not None and last.group == step.group:
            stages[-1] = Stage((*last.nodes, node), step.group)
        else:
            stages.append(Stage((node,), step.group or None))
    runs = tuple(_run(r, attempts.get(r.run_id), now) for r in task.runs)
    earlier: tuple[Earlier, ...] = ()
    if task.continued is not None:
        earlier = tuple(Earlier(j.n, j.steps, j.last or "", j.at) for j in task.continued.journals)
    error = last_line(task.error) or last_line(task.invalid_reason)
    if not error and task.runs:
        error = last_line(task.runs[-1].error)
    said = state in ("failed", "invalid", "retrying", "cancelled") and failed_at is None
    end = End(
        state,
        error if said else "",  # a failed step shows its own error
        state == "failed" and failed_at is None,
        task.finished_at,
    )
    return Graph(
        tuple(stages),
        runs,
        task.runs_folded or 0,
        earlier,
        task.continued.n if task.continued is not None else 0,
        end,
        retriable,
    )


def _failed_at(task: Task) -> int | None:
    """Where the task failed (its place, from 1), if it failed (or waits for its retry): the
    last failed step of the journal's last stage. A failed step with steps after it (in other
    stages) was caught by the handler. By place: a hand-edited journal may repeat a name."""
    if task.status not in (TaskStatus.FAILED, TaskStatus.PENDING) or not task.steps:
        return None
    group = task.steps[-1].group
    place = len(task.steps)
    while place > 0:
        step = task.steps[place - 1]
        if step.state == "failed":
            return place
        if not group or step.group != group:
            return None
        place -= 1
    return None


def seconds_between(start: dt.datetime | None, end: dt.datetime | None) -> float | None:
    """``end - start`` in seconds; ``None`` for a missing date or a negative span (a date
    without a time zone is read as UTC, as MongoDB stores dates)."""
    if start is None or end is None:
        return None
    if start.tzinfo is None:
        start = start.replace(tzinfo=dt.UTC)
    if end.tzinfo is None:
        end = end.replace(tzinfo=dt.UTC)
    seconds = (end - start).total_seconds()
    return seconds if seconds >= 0 else None


def _node(
    place: int,
    step: Step,
    now: dt.datetime,
    by_step: dict[str, list[Child]],
    retriable: bool,
    ended: bool,
    current: bool,
) -> Node:
    so_far = step.state == "waiting" or (step.finished_at is None and step.kind in WAITS)
    if step.kind == "call" and step.ms is not None:
        seconds: float | None = step.ms / 1000
    else:
        seconds = seconds_between(step.started_at, now if so_far else step.finished_at)
    kids = tuple(by_step.get(step.name, ())) if step.kind == "children" else ()
    read = {c.key for c in kids}
    kids += tuple(c for c in _failures(step) if c.key not in read)  # failed, not read
    total = step.total or 0
    return Node(
        place=place,
        name=step.name,
        kind=step.kind,
        state=step.state,
        seconds=seconds,
        so_far=so_far,
        attempts=step.attempts,
        tries=tuple(
            Try(t.at, t.ms / 1000, t.run_id[:8], t.attempt, last_line(t.error))
            for t in step.tries
            if t.error
        ),
        detail=_detail(step, current),
        error=last_line(step.error),
        run=step.run_id[:8],
        attempt=step.attempt,
        failed=step.state == "failed",
        ended_task=ended,
        retry_from=retriable,
        children=kids,
        children_more=max(0, total - len(kids)),
    )


def _failures(step: Step) -> tuple[Child, ...]:
    """A spawn's failed children as its entry names them (its first 20)."""
    found = []
    for f in step.failures:
        key = f.get("key")
        if isinstance(key, str) and key:
            name, status = f.get("name"), f.get("status")
            found.append(
                Child(
                    key,
                    name if isinstance(name, str) else "",
                    status if isinstance(status, str) else "failed",
                    None,
                    last_line(f.get("error") if isinstance(f.get("error"), str) else None),
                )
            )
    return tuple(found)


def _until(value: dt.datetime | None) -> str:
    if value is None:
        return ""
    if value.year >= NEVER_YEAR:
        return "no deadline"
    return value.strftime("%Y-%m-%d %H:%M:%S")


def _detail(step: Step, current: bool) -> str:
    """What the step is about, in a few words: the signal, the collection, the sleep's end
    (not for the wait the task is in: the page's reason says when it ends)."""
    end = "" if current else _until(step.until)
    if step.kind == "sleep":
        return f"until {end}" if end else ""
    deadline = f"deadline {end}" if end and end != "no deadline" else end
    if step.kind == "signal":
        nth = f" #{step.nth + 1}" if step.nth else ""
        return f"signal {step.signal or '?'}{nth}" + (f", {deadline}" if deadline else "")
    if step.kind == "data":
        return f"data in {step.collection or '?'}" + (f", {deadline}" if deadline else "")
    if step.kind == "children":
        failed = f", {step.failed} failed" if step.failed else ""
        return f"{step.total or 0} children{failed}"
    if step.kind == "patch":
        return "new branch" if step.result else "old branch"
    return ""


def _child(kid: Task, state: str) -> Child:
    error = ""
    if state in ("failed", "retrying", "invalid", "cancelled"):
        error = last_line(kid.error) or last_line(kid.invalid_reason)
    return Child(
        kid.key,
        kid.name or "",
        state,
        seconds_between(kid.created_at, kid.finished_at),
        error,
    )


def _run(run: Run, attempt: int | None, now: dt.datetime) -> RunNode:
    so_far = run.finished_at is None and run.state == "RUNNING"
    return RunNode(
        run.run_id[:8],
        run.worker_id,
        str(run.state.value),
        attempt,
        seconds_between(run.claimed_at, now if so_far else run.finished_at),
        so_far,
        last_line(run.error),
    )
