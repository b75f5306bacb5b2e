"""How a task reads on the command line: ``mtask get``'s page (its state and why, the facts,
its runs, steps and what it waits for), ``mtask list``'s lines, the counts per name and derived
state of ``mtask stats`` and ``mtask top``, ``mtask flow``'s tree. The dashboard draws the same
from the same ``mtask.explain.states.explain``.

Readable at 80 columns and in a pipe. What it shows (models, states, wording, tracebacks) is
imported where it is drawn: ``mtask --help`` imports none of it.
"""

from __future__ import annotations

import datetime as dt
import json
from collections import Counter
from typing import TYPE_CHECKING, Any

from mtask.cli.common import add_row, fitting_table, json_default, out, status_columns, when

if TYPE_CHECKING:
    from mtask.explain.states import Explained
    from mtask.models import OutputCounts, PublishResult, Task
    from mtask.store.cluster import StateCounts
    from mtask.store.counts import Counts


def _count(value: int | None) -> str:
    """A count as shown: ``-`` where the document holds none (a hand-written one marked
    invalid), never ``None``."""
    return "-" if value is None else str(value)


def state_json(said: Explained) -> dict[str, Any]:
    return {"state": said.state.value, "why": said.why, "reason": said.reason}


def _plural(count: int, noun: str, many: str | None = None) -> str:
    from mtask.explain.wording import plural

    return plural(count, noun, many)


def _state_cell(said: Explained) -> str:
    """``blocked · group``: a derived state and its reason's kind (``states.label``)."""
    from mtask.explain.states import label

    return label(said.state.value, said.why)


def _error_row(task: Task, said: Explained) -> list[tuple[str, str]]:
    """A failed or retrying task's error: its last line, and where in the user's code it was
    raised (``--traceback`` prints it all, mtask's own frames folded). ``get`` prints it in
    its header for these two states only (else its runs say it)."""
    from mtask.explain.states import State
    from mtask.explain.tracebacks import fold

    if said.state not in (State.FAILED, State.RETRYING) or not task.error:
        return []
    folded = fold(task.error)
    origin = f" (in {folded.origin.where})" if folded.origin else ""
    return [("error", f"{folded.exception}{origin}")]


def _header_rows(task: Task, said: Explained, now: dt.datetime) -> list[tuple[str, str]]:
    from mtask.explain.states import State, attempt_text, timing
    from mtask.explain.wording import relative
    from mtask.security.encryption import shown

    created = f"{when(task.created_at)} ({relative(task.created_at, now)})"
    rows = [("state", _state_cell(said)), ("why", said.reason), ("name", task.name or "-")]
    if task.options.group is not None:
        rows.append(("group", task.options.group))
    if task.options.priority:
        rows.append(("priority", str(task.options.priority)))
    runs = f"{task.attempts} run{'s' if task.attempts != 1 else ''}" if task.attempts else "none"
    attempt = f"{attempt_text(task)} (runs: {runs})"
    if task.attempts is None:  # a hand-written document without its counts: say so
        attempt = f"- (successes {_count(task.successes)}, failures {_count(task.failures)})"
    rows.append(("attempt", attempt))
    if task.snoozes:  # runs put off by Snooze, no retry spent
        rows.append(("snoozed", f"{task.snoozes} time{'s' if task.snoozes != 1 else ''}"))
    rows.append(("created", created))
    next_time = timing(task, said)
    if next_time is not None:
        label, at = next_time
        rows.append((label, "no deadline" if at is None else f"{when(at)} ({relative(at, now)})"))
    if task.finished_at is not None:
        rows.append(("finished", f"{when(task.finished_at)} ({relative(task.finished_at, now)})"))
    rows += _error_row(task, said)
    if said.state is State.SUCCEEDED:
        rows.append(("result", json.dumps(shown(task.result), default=json_default)))
    rows.append(("params", json.dumps(shown(task.params), default=json_default)))
    changed = task.options.changed()
    rows.append(("options", json.dumps(changed, default=json_default) if changed else "defaults"))
    return rows


def print_task(task: Task, said: Explained | None = None, now: dt.datetime | None = None) -> None:
    """A task as ``mtask get`` prints it, readable at 80 columns: its key, derived state and
    why, the facts, then its runs (each error's last line), steps and what it waits for.
    Without ``said`` (``mtask wait``'s finished task), the state is told from the document
    alone, as of its last change."""
    from rich.table import Table
    from rich.text import Text

    from mtask.explain.states import Cluster, explain

    if now is None:
        now = task.finished_at or task.updated_at or task.created_at or dt.datetime.now(dt.UTC)
    if said is None:
        said = explain(task, Cluster(now))

    out.print(Text(task.key, style="bold"))
    grid = Table.grid(padding=(0, 2))
    grid.add_column(no_wrap=True)
    grid.add_column(overflow="fold")
    rows = [*_header_rows(task, said, now), *_progress_rows(task)]
    rows += [*_flow_rows(task), *_usage_rows(task), *_waiting_rows(task)]
    for label, value in rows:
        add_row(grid, Text(label, style="bold"), value)
    out.print(grid)
    if task.runs:
        out.print(runs_table(task, now))
    if task.steps:
        out.print(steps_table(task))


def runs_table(task: Task, now: dt.datetime) -> Any:
    """The runs, oldest first: each error's last line (``--traceback`` prints them whole)."""
    from rich.table import Table

    from mtask.explain.states import last_line
    from mtask.explain.wording import span

    talked = any(run.output for run in task.runs)
    spent = any(run.usage for run in task.runs)
    headers = ["run", "worker", "state", "claimed (UTC)", "took", "output", "usage", "error"]
    shown = {"output": talked, "usage": spent}
    runs = Table(*(h for h in headers if shown.get(h, True)))
    runs.columns[1].overflow = "fold"
    runs.columns[3].no_wrap = True
    runs.columns[-1].overflow = "fold"
    runs.columns[-1].ratio = 1
    for run in task.runs:
        took = span(((run.finished_at or now) - run.claimed_at).total_seconds())
        cells = [run.run_id[:8], run.worker_id, run.state.value, _short(run.claimed_at)]
        cells.append(took if run.finished_at else f"{took}…")
        cells += [_output_cell(run.output)] if talked else []
        cells += [_usage_cell(run.usage)] if spent else []
        add_row(runs, *cells, last_line(run.error))
    return runs


def print_tracebacks(task: Task) -> None:
    """``get --traceback``: the task's error, then each run's that differs, mtask's own frames
    folded to one line each (``--json`` has them as stored)."""
    from mtask.explain.tracebacks import folded_text

    seen = set()
    for label, text in [
        ("error", task.error),
        *((f"run {r.run_id[:8]}", r.error) for r in task.runs),
    ]:
        if not text or text in seen:
            continue
        seen.add(text)
        out.print(f"\n{label}:", markup=False)
        out.print(folded_text(text), markup=False)


def _short(at: dt.datetime | None) -> str:
    """A time in a table at 80 columns: ``11-28 04:22:04`` (the year is in the header)."""
    return at.strftime("%m-%d %H:%M:%S") if at is not None else "-"


def _deadline(at: dt.datetime | None) -> str:
    from mtask.steps import NEVER

    return "no deadline" if at is None or at.year >= NEVER.year else f"until {when(at)}"


def _waiting_rows(task: Task) -> list[tuple[str, str]]:
    """What a waiting task waits for, and the signals it was sent."""
    from mtask.vocabulary import TaskStatus, bson_json

    rows = []
    w = task.waiting
    if w is not None and task.status == TaskStatus.PENDING:
        what = f"signal {w.signal!r}, {_deadline(w.until)}" if w.signal else f"{_deadline(w.until)}"
        if w.data is not None:  # a wait on data (ctx.wait_until)
            shown = json.dumps(bson_json(w.data.filter))
            what = f"{w.data.collection} {shown}, {_deadline(w.until)}"
        if w.children is not None:  # its children, holding no slot
            what = "its children (they hold the slot, not it)"
        rows.append(("waiting", f"{what} (step {w.index + 1}: {w.step or '-'})"))
    if task.signals:
        names = Counter(s.name for s in task.signals)
        listed = ", ".join(f"{n} x{c}" if c > 1 else n for n, c in names.items())
        rows.append(("signals", f"{len(task.signals)}: {listed}"))
    return rows


def steps_table(task: Task) -> Any:
    """One row per durable step, in the handler's order; a step's earlier tries
    as a count of failures with the newest error. A sleep's or a wait's time is how long it
    slept or waited, not its call's."""
    from rich.table import Table

    table = Table("#", "step", "kind", "state", "tries", "took", "started", "detail")
    table.columns[1].overflow = "fold"
    table.columns[6].no_wrap = True
    table.columns[7].overflow = "fold"
    table.columns[7].ratio = 1
    for i, step in enumerate(task.steps, 1):
        add_row(
            table,
            str(i),
            step.name,
            step.kind,
            step.state,
            str(step.attempts) if step.kind == "call" else "",
            _took(step),
            _short(step.started_at),
            _step_detail(step),
        )
    return table


def _took(step: Any) -> str:
    from mtask.explain.wording import span

    if step.kind == "call":
        return "" if step.ms is None else span(step.ms / 1000)
    return (
        ""
        if step.finished_at is None
        else span((step.finished_at - step.started_at).total_seconds())
    )


def _step_detail(step: Any) -> str:
    from mtask.explain.states import last_line

    detail = []
    if step.kind == "sleep":
        detail.append(_deadline(step.until))
    elif step.kind == "signal":
        detail.append(f"{step.signal!r} #{(step.nth or 0) + 1}, {_deadline(step.until)}")
    detail += _workflow_detail(step)
    if step.spill:
        detail.append(f"result aside: {step.spill.get('bytes', '?')} bytes")
    if step.transactional:
        detail.append("transactional")
    failed = [t for t in step.tries if t.error]
    if step.error:
        detail.append(f"error: {last_line(step.error)}")
    elif failed:
        detail.append(
            f"{_plural(len(failed), 'failed try', 'failed tries')}, last: {failed[-1].error}"
        )
    return "; ".join(detail)


def _workflow_detail(step: Any) -> list[str]:
    """A parallel step's gather, a spawn's children, a patch marker's branch, a
    value decided once."""
    detail = [f"parallel ({step.group})"] if step.group else []
    if step.kind == "children":
        failed = f", {step.failed} failed" if step.failed else ""
        detail.append(f"{_plural(step.total or 0, 'child', 'children')}{failed}")
        detail += [f"{f.get('key')} {f.get('status')}" for f in step.failures[:3]]
    elif step.kind == "patch":
        detail.append("new branch" if step.result else "old branch")
    elif step.kind == "value" and step.result is not None:
        detail.append(str(step.result)[:40])
    return detail


def _progress_rows(task: Task) -> list[tuple[str, str]]:
    """The newest progress, and where the output is."""
    rows = []
    if task.progress is not None:
        p = task.progress
        share = "" if p.fraction is None else f"{p.fraction:.0%} "
        rows.append(("progress", f"{share}{p.label or ''} (run {p.run_id[:8]}, {when(p.at)})"))
    if task.output_seq:
        rows.append(
            ("output", f"{_plural(task.output_seq, 'entry', 'entries')}: mtask logs {task.key}")
        )
    return rows


def _output_cell(counts: OutputCounts | None) -> str:
    if counts is None:
        return ""
    text = f"{_plural(counts.logs, 'line')}, {_plural(counts.chunks, 'chunk')}"
    dropped = counts.logs_dropped + counts.chunks_dropped
    return f"{text} ({dropped} dropped: truncated)" if dropped else text


def _continued(task: Task) -> str:
    """How often the task continued as new, and the journals it left (the newest ones)."""
    c = task.continued
    assert c is not None
    left = "; ".join(
        f"#{j.n}: {_plural(j.steps, 'step')}" + (f", last {j.last}" if j.last else "")
        for j in c.journals[-3:]
    )
    return f"{_plural(c.n, 'time')} as new, last {when(c.at)}" + (f" ({left})" if left else "")


def _flow_rows(task: Task) -> list[tuple[str, str]]:
    rows = [("invalid", task.invalid_reason)] if task.invalid_reason else []
    rows += [("problem", p) for p in task.problems]  # what is wrong where
    if task.parent:
        spawn = task.spawn  # a spawned child says by which step, and its place
        by = f" (spawned by step {spawn.step}, child {spawn.index + 1})" if spawn else ""
        rows.append(("parent", task.parent + by))
    if task.triggered_by is not None:  # "published by trigger `fulfil` for `orders/o-1`"
        rows.append(("published", task.triggered_by.said().removeprefix("published ")))
    if task.children:
        rows.append(("children", ", ".join(task.children)))
    if task.spawned is not None:
        s = task.spawned
        failed = f", {s.failed} failed" if s.failed else ""
        rows.append(("spawned", f"{s.done} of {s.total} finished{failed} (step {s.step}; "
                     f"mtask flow {task.key})"))  # fmt: skip
    if task.continued is not None:
        rows.append(("continued", _continued(task)))
    if task.options.deadline is not None:
        rows.append(("deadline", f"{when(task.options.deadline)} (the whole task)"))
    # outbox entries no step could be built from (flows.read_outbox): kept, not published
    rows += [("step not published", str(r.get("reason"))) for r in task.outbox_rejected]
    if task.depends_on:
        pending = task.status is not None and not task.status.finished
        waiting = ""
        if task.waiting_on:  # a finished task waits on nothing: those never succeeded
            listed = ", ".join(task.waiting_on)
            waiting = f" (waiting on {listed})" if pending else f" ({listed} did not succeed)"
        rows.append(("depends on", ", ".join(task.depends_on) + waiting))
    return rows


def _usage_cell(usage: Any) -> str:
    if usage is None:
        return "-"
    tokens = f"{usage.input_tokens + usage.output_tokens:,} tok"
    return tokens if usage.cost is None else f"{tokens}, {usage.cost.normalize():f}"


def _usage_rows(task: Task) -> list[tuple[str, str]]:
    """What the task spent (``ctx.record_usage``), per model, and its budget."""
    from mtask.usage.rules import usage_text

    rows: list[tuple[str, str]] = []
    if task.usage is not None:
        rows.append(("usage", usage_text(task.usage)))
        for model in task.usage.models or []:
            rows.append((f"  {model.model}", usage_text(model)))
    if task.options.budget is not None:
        rows.append(("budget", f"{task.options.budget.describe()} (the task)"))
    return rows


def _why_cell(task: Task, said: Explained) -> str:
    """What a list says of a task beside its state: the error's last line of a failed,
    retrying or invalid one; why a waiting or blocked one does not run."""
    from mtask.explain.states import State, last_line

    if said.state in (State.FAILED, State.RETRYING):
        return last_line(task.error)
    if said.state is State.INVALID:
        return f"invalid: {last_line(task.invalid_reason)}"
    if said.state in (State.WAITING, State.BLOCKED):
        return said.reason
    return ""


def print_list(rows: list[tuple[Task, Explained]], now: dt.datetime) -> None:
    """One line a task (key, name, state, tries, created), and under it, indented, why a
    waiting or blocked one does not run or a failed one's error: readable at 80 columns, keys
    never cut."""
    import textwrap

    from mtask.explain.wording import relative

    if not rows:
        out.print("no tasks match", markup=False)
        return
    cells = [
        (t.key, t.name or "-", _state_cell(e), _count(t.attempts), relative(t.created_at, now))
        for t, e in rows
    ]
    header = ("key", "name", "state", "tries", "created")
    widths = [min(max(len(c[i]) for c in [header, *cells]), cap) for i, cap in enumerate(CAPS)]
    width = max(40, out.console.width if out.rich_available else 80)
    lines = [_columns(header, widths)]
    for (t, said), row in zip(rows, cells, strict=True):
        lines.append(_columns(row, widths))
        why = _why_cell(t, said)
        if why:
            lines += textwrap.wrap(why, width - 4, initial_indent="    ", subsequent_indent="    ")
    out.print("\n".join(lines), markup=False)


CAPS = (28, 16, 22, 5, 12)
"""The widest each column of ``mtask list`` pads to (a longer key is printed whole)."""


def _columns(cells: tuple[str, ...], widths: list[int]) -> str:
    return "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()


def stats_table(counts: Counts) -> Any:
    """Counts per name and stored status (``mtask stats --by status``), readable at 80 columns:
    a status no task is in takes no column, and a name is never cut short."""
    from mtask.vocabulary import TaskStatus

    statuses = status_columns(counts, [s.value for s in TaskStatus])
    notes = _bound_note(counts)
    notes += _none_note(statuses, [s.value for s in TaskStatus])
    table = fitting_table("name", *statuses, "total", caption="; ".join(notes) or None)
    for name in sorted(counts):
        row = counts[name]
        more = "+" if any(counts.is_lower_bound(name, s) for s in row) else ""
        cells = [counts.show(name, s) for s in statuses]
        add_row(table, name, *cells, f"{sum(row.values()):,}{more}")
    return table


def state_table(
    split: StateCounts, *, title: str | None = None, rates: dict[str, str] | None = None
) -> Any:
    """Counts per name and derived state (``mtask stats``, ``mtask top``): the states of
    ``mtask list``, ``mtask get`` and the dashboard, readable at 80 columns (a state no task is
    in takes no column, a name is never cut short). The pending tasks of a name beyond the
    newest ``SPLIT_UP_TO`` are counted apart, as not split."""
    from mtask.explain.states import STATES
    from mtask.store.cluster import SPLIT_UP_TO

    states = status_columns(split.counts, STATES)
    notes = _bound_note(split.stored)
    if split.unsplit:
        notes.append(
            f"not split: pending tasks beyond the newest {SPLIT_UP_TO:,} of a name, whose "
            "state was not derived"
        )
    notes += _none_note(states, list(STATES))
    more = ["not split"] if split.unsplit else []
    rate = ["finished/s"] if rates is not None else []
    headers = ["name", *states, *more, "total", *rate]
    rows = []
    for name in sorted(split.counts):
        row = split.counts[name]
        bound = "+" if any(split.stored.is_lower_bound(name, s) for s in row) else ""
        total = sum(row.values()) + split.unsplit.get(name, 0)
        cells = [split.show(name, s) for s in states]
        cells += [f"{split.unsplit.get(name, 0):,}"] if more else []
        cells += [f"{total:,}{bound}"] + ([rates.get(name, "")] if rates is not None else [])
        rows.append([name, *cells])
    caption = "; ".join(notes) or None
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]
    if sum(widths) + 2 * (len(widths) - 1) > _width():
        return _state_lines(headers, rows, title, caption)
    table = fitting_table(*headers, title=title, caption=caption)
    for cells in rows:
        add_row(table, *cells)
    return table


def _width() -> int:
    return out.console.width if out.rich_available else 80


def _state_lines(
    headers: list[str], rows: list[list[str]], title: str | None, caption: str | None
) -> Any:
    """The counts too wide for a table at this width (as many states as a pipe's 80 columns
    cannot hold): a name a line, then its states with a count, each whole (``kubectl``'s
    narrow form rather than headers cut to ``sched…``)."""
    import textwrap

    from rich.text import Text

    lines = [title] if title else []
    for name, *cells in rows:
        said = [f"{c} {h}" for h, c in zip(headers[1:], cells, strict=True) if c not in ("0", "")]
        lines.append(name)
        line = ""
        for item in said:  # greedy, never breaking inside "3 blocked"
            joined = f"{line} · {item}" if line else item
            if line and len(joined) + 4 > _width():
                lines.append(f"    {line}")
                joined = item
            line = joined
        lines.append(f"    {line}")
    if caption:
        lines += textwrap.wrap(caption, _width())
    return Text("\n".join(lines))


def _bound_note(counts: Counts) -> list[str]:
    if not counts.at_least:
        return []
    return [
        f"{counts.exact_up_to:,}+: more than that many finished tasks (--exact counts them "
        "all, at a cost that grows with the collection)"
    ]


def _none_note(shown: list[str], every: list[str]) -> list[str]:
    """``none running, succeeded or failed``: the columns left out, said once."""
    empty = [s for s in every if s not in shown]
    if not empty or len(empty) == len(every):
        return []
    listed = f"{', '.join(empty[:-1])} or {empty[-1]}" if len(empty) > 1 else empty[0]
    return [f"none {listed}"]


def state_counts_json(split: StateCounts) -> dict[str, dict[str, int]]:
    """``mtask stats --json``: per name and derived state; a name's pending tasks not split
    under ``pending_not_split``."""
    shown = {name: dict(row) for name, row in split.counts.items()}
    for name, n in split.unsplit.items():
        shown.setdefault(name, {})["pending_not_split"] = n
    return shown


def groups_table(groups: list[dict[str, Any]]) -> Any:
    """``mtask stats``' largest groups (``options.group``) by open tasks."""
    largest = fitting_table(
        "name", "group", "open", "running", fold=("group",), title="largest groups (open tasks)"
    )
    for g in groups:
        add_row(largest, g["name"], g["group"], f"{g['open']:,}", f"{g['running']:,}")
    return largest


def flow_tree(tree: dict[str, Any]) -> Any:
    """``mtask flow``: a task and the tasks below it, each with its derived state (``blocked ·
    group``) and, for one that does not run, why; the tree the dashboard's flow view draws."""
    from rich.tree import Tree

    root = Tree(_flow_label(tree))
    stack = [(root, tree)]
    while stack:
        branch, node = stack.pop()
        for child in node["children"]:
            stack.append((branch.add(_flow_label(child)), child))
    return root


def _flow_label(node: dict[str, Any]) -> Any:
    from rich.text import Text

    from mtask.explain.states import label as state_label

    state = state_label(str(node.get("state") or node.get("status")), node.get("why"))
    label = Text(f"{node.get('key')}  {node.get('name')}  ")
    label.append(state, style="bold")
    if node.get("state") in ("waiting", "blocked") and node.get("reason"):
        label.append(f"  {node['reason']}", style="dim")
    return label


def workers_table(workers: list[dict[str, Any]]) -> Any:
    """``mtask workers``: one row a live worker."""
    from rich.table import Table

    table = Table("worker", "names", "in flight", "concurrency", "state", "started", "last seen")
    for w in workers:  # models.read_worker: every field in its shape, or its default
        add_row(
            table,
            w["_id"],
            ",".join(w["names"] or []),
            str(w["in_flight"] if w["in_flight"] is not None else 0),
            str(w["concurrency"] if w["concurrency"] is not None else ""),
            w["state"] or "",
            when(w["started_at"]),
            when(w["last_seen"]),
        )
    return table


def print_published(result: PublishResult, said: Explained | None) -> None:
    """What ``mtask publish`` did, and the task's derived state: why it will not run yet (no
    live worker handles its name, a dependency no task has, its name paused, …), as ``get``
    says it."""
    from mtask.explain.states import State

    what = "created" if result.created else ("updated" if result.updated else "exists")
    if result.dropped:  # an older task kept its place
        what = f"dropped: {result.task.key}'s publish; kept"
    state = str(result.task.status) if said is None else _state_cell(said)
    out.print(f"{what}: {result.task.key} ({result.task.name}, {state})", markup=False)
    if said is not None and said.state in (State.WAITING, State.BLOCKED):
        later = " (yet: a worker that handles it claims it once it runs)"
        out.print(f"  why: {said.reason}{later if said.why == 'no_worker' else ''}", markup=False)
    if result.superseded:
        out.print(f"superseded: {', '.join(result.superseded)}", markup=False)
