"""The task commands: ``publish`` (one task, or JSON lines with ``--from-file``), ``get``,
``list``, ``stats``, ``cancel``, ``retry``, ``workers``, ``pause`` and ``resume``."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import sys
from collections import Counter
from typing import IO, TYPE_CHECKING, Any

from mtask.cli import bulk
from mtask.cli.common import (
    STATUSES,
    Choices,
    Commands,
    add_common,
    add_row,
    choose,
    fitting_table,
    json_default,
    out,
    parse_json,
    parse_json_object,
    print_json,
    status_columns,
    task_client,
    when,
)
from mtask.errors import InvalidTask, TaskNotFound, UsageError

if TYPE_CHECKING:
    from mtask.explain.states import Explained
    from mtask.models import OutputCounts, Task
    from mtask.store.counts import Counts

# What the commands show (models, states, wording, tracebacks) is imported by the handler that
# shows it: building the parser (`mtask --help`) imports none of it.

BATCH = 1000


def _on_conflict() -> tuple[str, ...]:
    from mtask.models import ON_CONFLICT_CHOICES

    return ON_CONFLICT_CHOICES


def _states() -> tuple[str, ...]:
    from mtask.explain.states import STATES

    return tuple(STATES)


def _policies() -> tuple[str, ...]:
    from mtask.store.supersede import POLICIES

    return POLICIES


ON_CONFLICT = Choices(_on_conflict)
commands = Commands()
run = commands.run


def _options_from_args(args: argparse.Namespace) -> dict[str, Any]:
    options = parse_json_object(args.options, "--options") if args.options else {}
    flags = {
        "priority": args.priority,
        "concurrency": args.concurrency,
        "max_retries": args.max_retries,
        "worker_timeout_ms": args.worker_timeout_ms,
        "ping_interval_ms": args.ping_interval_ms,
    }
    options.update({k: v for k, v in flags.items() if v is not None})
    if args.worker:
        options["specific_worker_ids"] = args.worker
    return options


def _count(value: int | None) -> str:
    """A count as shown: ``-`` where the document holds none (a hand-written one marked
    invalid), never ``None``."""
    return "-" if value is None else str(value)


@commands.command("publish")
def cmd_publish(args: argparse.Namespace) -> int:
    if args.from_file is not None:
        if args.name is not None or args.key is not None:
            raise UsageError("give NAME KEY or --from-file, not both")
        refuse_per_task_options(args)
        return publish_from_file(args)
    if args.name is None or args.key is None:
        raise UsageError("publish needs NAME and KEY (or --from-file FILE of JSON lines)")
    params = parse_json_object(args.params, "--params") if args.params else {}
    options = _options_from_args(args)
    with task_client(args) as client:
        result = client.publish(
            args.name,
            args.key,
            params,
            options=options,
            delay=args.delay,
            on_conflict=args.on_conflict,
            depends_on=args.depends_on,
            supersede=args.supersede,
            debounce=args.debounce,
            debounce_max=args.debounce_max,
        )
    if args.json:
        print_json(
            {
                "created": result.created,
                "updated": result.updated,
                "task": result.task.model_dump(by_alias=True),
                "superseded": result.superseded,
                "dropped": result.dropped,
            }
        )
    else:
        what = "created" if result.created else ("updated" if result.updated else "exists")
        if result.dropped:  # an older task kept its place
            what = f"dropped: {args.key}; kept"
        out.print(
            f"{what}: {result.task.key} ({result.task.name}, {result.task.status})", markup=False
        )
        if result.superseded:
            out.print(f"superseded: {', '.join(result.superseded)}", markup=False)
    return 0


@commands.command("get")
def cmd_get(args: argparse.Namespace) -> int:
    with task_client(args) as client:
        task = client.get(args.key)
        if task is None:
            raise TaskNotFound(args.key)
        said = client.explain(task)
        now = client.now()
    if args.json:
        from mtask.security.encryption import shown

        dumped = task.model_dump(by_alias=True)
        dumped["params"], dumped["result"] = shown(task.params), shown(task.result)
        print_json({**dumped, **_state_json(said)})
    else:
        print_task(task, said, now)
        if args.traceback:
            print_tracebacks(task)
    return 0


def _state_json(said: Explained) -> dict[str, Any]:
    return {"state": said.state.value, "why": said.why, "reason": said.reason}


def _state_cell(said: Explained) -> str:
    """``blocked · group``: a derived state and its reason's kind."""
    why = f" · {said.why.replace('_', ' ')}" if said.why and said.why != "backoff" else ""
    return f"{said.state.value}{why}"


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
    rows += [*_flow_rows(task), *_waiting_rows(task)]
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
    headers = ["run", "worker", "state", "claimed (UTC)", "took", "output", "error"]
    runs = Table(*(h for h in headers if talked or h != "output"))
    runs.columns[1].overflow = "fold"
    runs.columns[3].no_wrap = True
    runs.columns[-1].overflow = "fold"
    runs.columns[-1].ratio = 1
    for run in task.runs:
        took = span(((run.finished_at or now) - run.claimed_at).total_seconds())
        cells = [run.run_id[:8], run.worker_id, run.state.value, _short(run.claimed_at)]
        cells.append(took if run.finished_at else f"{took}…")
        cells += [_output_cell(run.output)] if talked else []
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
    from mtask.models import TaskStatus, bson_json

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
        detail.append(f"{len(failed)} failed tries, last: {failed[-1].error}")
    return "; ".join(detail)


def _workflow_detail(step: Any) -> list[str]:
    """A parallel step's gather, a spawn's children, a patch marker's branch, a
    value decided once."""
    detail = [f"parallel ({step.group})"] if step.group else []
    if step.kind == "children":
        failed = f", {step.failed} failed" if step.failed else ""
        detail.append(f"{step.total} children{failed}")
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
        rows.append(("output", f"{task.output_seq} entries: mtask logs {task.key}"))
    return rows


def _output_cell(counts: OutputCounts | None) -> str:
    if counts is None:
        return ""
    text = f"{counts.logs} lines, {counts.chunks} chunks"
    dropped = counts.logs_dropped + counts.chunks_dropped
    return f"{text} ({dropped} dropped: truncated)" if dropped else text


def _flow_rows(task: Task) -> list[tuple[str, str]]:
    rows = [("invalid", task.invalid_reason)] if task.invalid_reason else []
    rows += [("problem", p) for p in task.problems]  # what is wrong where
    if task.parent:
        spawn = task.spawn  # a spawned child says by which step, and its place
        by = f" (spawned by step {spawn.step}, child {spawn.index + 1})" if spawn else ""
        rows.append(("parent", task.parent + by))
    if task.children:
        rows.append(("children", ", ".join(task.children)))
    if task.spawned is not None:
        s = task.spawned
        failed = f", {s.failed} failed" if s.failed else ""
        rows.append(("spawned", f"{s.done} of {s.total} finished{failed} (step {s.step}; "
                     f"mtask flow {task.key})"))  # fmt: skip
    if task.options.deadline is not None:
        rows.append(("deadline", f"{when(task.options.deadline)} (the whole task)"))
    # outbox entries no step could be built from (flows.read_outbox): kept, not published
    rows += [("step not published", str(r.get("reason"))) for r in task.outbox_rejected]
    if task.depends_on:
        waiting = f" (waiting on {', '.join(task.waiting_on)})" if task.waiting_on else ""
        rows.append(("depends on", ", ".join(task.depends_on) + waiting))
    return rows


@commands.command("list")
def cmd_list(args: argparse.Namespace) -> int:
    if args.state is not None and (args.status is not None or args.order != "newest"):
        raise UsageError("--state lists newest first, without --status or --order")
    with task_client(args) as client:
        if args.state is not None:
            page = client.search_state(
                args.state, name=args.name, group=args.group, after=args.after, limit=args.limit
            )
            rows, more = page.tasks, page.after
            now = client.now()
        else:
            tasks = client.list(
                name=args.name,
                status=args.status,
                limit=args.limit,
                after=args.after,
                order=args.order,
                group=args.group,
            )
            rows = list(zip(tasks, client.explain_all(tasks), strict=True))
            more = tasks[-1].key if len(tasks) == args.limit else None
        now = client.now()
    if args.json:
        print_json([{**t.model_dump(by_alias=True), **_state_json(e)} for t, e in rows])
        return 0
    print_list(rows, now)
    if more is not None and args.state is not None:
        out.print(f"more may match: --after {more}", markup=False)
    return 0


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


@commands.command("stats")
def cmd_stats(args: argparse.Namespace) -> int:
    if args.groups < 0:
        raise UsageError("--groups must not be negative")
    with task_client(args) as client:
        counts = client.stats(exact=args.exact)
        groups = client.groups(top=args.groups) if args.groups else []
    if args.json:
        print_json(counts)
        return 0
    if not counts:
        out.print(
            f"no tasks yet in {args.database}.{args.collection} (mtask publish NAME KEY "
            "publishes one)",
            markup=False,
        )
        return 0
    out.print(stats_table(counts))
    if groups:
        largest = fitting_table(
            "name", "group", "open", "running", fold=("group",), title="largest groups (open tasks)"
        )
        for g in groups:
            add_row(largest, g["name"], g["group"], f"{g['open']:,}", f"{g['running']:,}")
        out.print(largest)
    return 0


def stats_table(counts: Counts) -> Any:
    """Counts per name and status, readable at 80 columns: a status no task is in takes no
    column, and a name is never cut short."""
    from mtask.models import TaskStatus

    statuses = status_columns(counts, [s.value for s in TaskStatus])
    notes = []
    if counts.at_least:
        notes.append(
            f"{counts.exact_up_to:,}+: more than that many finished tasks (--exact counts "
            "them all, at a cost that grows with the collection)"
        )
    if len(statuses) < len(TaskStatus):
        empty = [s.value for s in TaskStatus if s.value not in statuses]
        listed = f"{', '.join(empty[:-1])} or {empty[-1]}" if len(empty) > 1 else empty[0]
        notes.append(f"none {listed}")
    table = fitting_table("name", *statuses, "total", caption="; ".join(notes) or None)
    for name in sorted(counts):
        row = counts[name]
        more = "+" if any(counts.is_lower_bound(name, s) for s in row) else ""
        cells = [counts.show(name, s) for s in statuses]
        add_row(table, name, *cells, f"{sum(row.values()):,}{more}")
    return table


def _one_key(args: argparse.Namespace) -> str:
    if args.key is None:
        raise UsageError(f"{args.command} needs a KEY, or a filter (--name, --status, --key, …)")
    if bulk.has_filter(args):
        raise UsageError(f"give {args.command} a KEY or a filter, not both")
    return str(args.key)


def _act(args: argparse.Namespace, action: str, done: str) -> int:
    """``cancel`` or ``retry`` of one KEY, or of every task a filter matches (``bulk``)."""
    if args.key is None and bulk.has_filter(args):
        return bulk.run(args)
    key = _one_key(args)
    with task_client(args) as client:
        task = getattr(client, action)(key)
    out.print(f"{done}: {task.key}", markup=False)
    return 0


@commands.command("cancel")
def cmd_cancel(args: argparse.Namespace) -> int:
    return _act(args, "cancel", "cancelled")


@commands.command("retry")
def cmd_retry(args: argparse.Namespace) -> int:
    if getattr(args, "from_step", None) is None:
        return _act(args, "retry", "pending again")
    if args.key is None:  # run one task again from a step
        raise UsageError("--from-step applies to one task: give its KEY, not a filter")
    with task_client(args) as client:
        task = client.retry(_one_key(args), from_step=args.from_step)
    kept = ", ".join(s.name for s in task.steps) or "none"
    out.print(f"pending again from step {args.from_step}: {task.key}", markup=False)
    out.print(f"  the steps before it are kept and replayed: {kept}", markup=False)
    return 0


@commands.command("workers")
def cmd_workers(args: argparse.Namespace) -> int:
    with task_client(args) as client:
        workers = client.workers()
    if args.json:
        print_json(workers)
        return 0
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
    out.print(table)
    return 0


@commands.command("pause")
def cmd_pause(args: argparse.Namespace) -> int:
    with task_client(args) as client:
        client.pause(args.name)
    out.print(
        f"paused: {args.name} (no worker claims it until `mtask resume {args.name}`; runs in "
        "flight finish)",
        markup=False,
    )
    return 0


@commands.command("resume")
def cmd_resume(args: argparse.Namespace) -> int:
    with task_client(args) as client:
        client.resume(args.name)
    out.print(f"resumed: {args.name} (workers claim it again)", markup=False)
    return 0


def read_lines(stream: IO[str], source: str) -> tuple[list[dict[str, Any]], list[int]]:
    """Every line a JSON object (blank lines skipped), and the line number of each; an error
    names the line."""
    items = []
    lines = []
    number = 0
    try:
        for number, line in enumerate(stream, 1):
            if not line.strip():
                continue
            item = parse_json(line, f"{source}:{number}")
            if not isinstance(item, dict):
                raise UsageError(f"{source}:{number}: must be a JSON object")
            items.append(item)
            lines.append(number)
    except UnicodeDecodeError as exc:  # raised by the reading, for the lines after ``number``
        raise UsageError(f"{source}: not UTF-8 after line {number}: {exc.reason}") from None
    return items, lines


# The single publish's per-task options, as given on the command line: ``--from-file`` takes
# none of them (each line holds its own params, options, delay and depends_on; its tasks are
# inserted if absent, with no supersede policy and no debounce window).
PER_TASK_OPTIONS = {
    "params": "--params",
    "options": "--options",
    "priority": "--priority",
    "concurrency": "--concurrency",
    "max_retries": "--max-retries",
    "worker_timeout_ms": "--worker-timeout-ms",
    "ping_interval_ms": "--ping-interval-ms",
    "worker": "--worker",
    "delay": "--delay",
    "depends_on": "--depends-on",
    "supersede": "--supersede",
    "debounce": "--debounce",
    "debounce_max": "--debounce-max",
}


def refuse_per_task_options(args: argparse.Namespace) -> None:
    """A per-task option given with ``--from-file`` is refused, not silently ignored (it would
    apply to no line). ``--on-conflict ignore``, the default, is what the file's insert does."""
    given = [flag for attr, flag in PER_TASK_OPTIONS.items() if getattr(args, attr) is not None]
    if args.on_conflict != "ignore":
        given.append(f"--on-conflict {args.on_conflict}")
    if given:
        raise UsageError(
            f"{', '.join(given)} cannot be used with --from-file (each line holds its own "
            "params, options, delay and depends_on; a file's tasks are inserted if absent, "
            "with no supersede policy or debounce)"
        )


def publish_from_file(args: argparse.Namespace) -> int:
    """Validate every line first (nothing is written if one is bad), then publish in batches
    with a progress bar."""
    from mtask.client import build_many

    source = "stdin" if args.from_file == "-" else args.from_file
    try:
        if args.from_file == "-":
            items, lines = read_lines(sys.stdin, source)
        else:
            with open(args.from_file, encoding="utf-8") as stream:
                items, lines = read_lines(stream, source)
    except OSError as exc:
        raise UsageError(f"cannot read {source}: {exc.strerror}") from None
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    with task_client(args) as client:
        now = client.now()
        try:
            build_many(items, now, client.max_params_bytes)
        except InvalidTask as exc:  # "items[3].key: …" -> "file:5: key: …"
            found = re.match(r"items\[(\d+)\]\.?(.*)", exc.message, flags=re.S)
            where = f"{source}:{lines[int(found[1])]}" if found else source
            raise InvalidTask(f"{where}: {found[2] if found else exc.message}") from None
        created = 0
        progress = Progress(
            TextColumn("publishing"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            console=out.console, disable=args.json or not out.is_terminal,
        )  # fmt: skip
        with progress:
            bar = progress.add_task("publish", total=len(items))
            for start in range(0, len(items), BATCH):
                chunk = items[start : start + BATCH]
                created += client.publish_many(chunk)
                progress.advance(bar, len(chunk))
    if args.json:
        print_json({"created": created, "given": len(items)})
    else:
        out.print(f"published {len(items)} tasks from {source}: {created} created", markup=False)
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser("publish", help="publish a task (idempotent by key)")
    add_common(p)
    p.add_argument("name", nargs="?", help="the task's name: which handler runs it")
    p.add_argument("key", nargs="?", help="the task's key: publishing it again changes nothing")
    p.add_argument(
        "--from-file",
        metavar="FILE",
        help="publish JSON lines ({name, key, params, options, delay, depends_on}); - for "
        "stdin; the per-task options below are refused with it",
    )
    p.add_argument("--params", metavar="JSON", help="the handler's input: a JSON object")
    p.add_argument(
        "--options", metavar="JSON", help="task options as a JSON object (docs/design.md)"
    )
    p.add_argument("--priority", type=int, metavar="N", help="higher is claimed first (default 0)")
    p.add_argument(
        "--concurrency",
        type=int,
        metavar="N",
        help="how many distinct workers must run it successfully (default 1)",
    )
    p.add_argument(
        "--max-retries",
        type=int,
        metavar="N",
        help="failures allowed before it fails for good (default 3)",
    )
    p.add_argument(
        "--worker-timeout-ms",
        type=int,
        metavar="MS",
        help="the lease: a run not pinged for this long is taken over (default 30000)",
    )
    p.add_argument(
        "--ping-interval-ms",
        type=int,
        metavar="MS",
        help="how often a running worker extends its lease (default 5000)",
    )
    p.add_argument("--worker", action="append", metavar="ID", help="only this worker id may run it")
    p.add_argument(
        "--delay",
        type=float,
        metavar="SECONDS",
        help="seconds before it may run (the server's clock)",
    )
    conflict = p.add_argument(
        "--on-conflict",
        default="ignore",
        help="when the key exists: change nothing, replace the params and options of a task "
        "not running, or make a finished task new again",
    )
    choose(conflict, ON_CONFLICT)
    p.add_argument(
        "--depends-on", action="append", metavar="KEY", help="run only after this task succeeded"
    )
    supersede = p.add_argument(
        "--supersede",
        help="one open task of its name and group among those published with a policy: drop "
        "this newer one, cancel the queued older one, or cancel the older one even running",
    )
    choose(supersede, Choices(_policies))
    p.add_argument(
        "--debounce",
        type=float,
        metavar="SECONDS",
        help="publishes of KEY this close together collapse into one run, this long after the "
        "last (the last params win; the task's key is KEY~<first publish>)",
    )
    p.add_argument(
        "--debounce-max",
        type=float,
        metavar="SECONDS",
        help="with --debounce: the run starts at most this long after the first publish",
    )

    p = sub.add_parser("get", help="show one task: its state and why, runs, steps")
    add_common(p)
    p.add_argument("key", help="the task's key")
    p.add_argument(
        "--traceback",
        action="store_true",
        help="print the error's traceback, mtask's own frames folded (--json: as stored)",
    )

    p = sub.add_parser("list", help="list tasks")
    add_common(p)
    p.add_argument("--name", help="only tasks of this name")
    choose(p.add_argument("--status", help="only this status"), STATUSES)
    state = p.add_argument(
        "--state",
        help="only tasks in this derived state (blocked, waiting, retrying, …), newest first",
    )
    choose(state, Choices(_states))
    p.add_argument("--limit", type=int, default=50, help="at most this many (default 50)")
    p.add_argument("--after", help="last key of the previous page")
    p.add_argument(
        "--order",
        choices=["newest", "next_claim_at"],
        default="newest",
        help="newest first, or soonest claimable first",
    )
    p.add_argument("--group", help="only the tasks of this group (options.group)")

    p = sub.add_parser("stats", help="counts per name and status")
    add_common(p)
    p.add_argument(
        "--exact",
        action="store_true",
        help="count every finished task exactly (by default, above 1,000 per name and status "
        "the count says 1,000+)",
    )
    p.add_argument(
        "--groups",
        type=int,
        default=10,
        metavar="N",
        help="show the N groups (options.group) with the most open tasks (default 10; 0: none)",
    )

    for name, text in (
        ("cancel", "cancel a task, or the tasks a filter matches"),
        ("retry", "run a failed/cancelled task again, or the tasks a filter matches"),
    ):
        p = sub.add_parser(name, help=text)
        add_common(p)
        p.add_argument("key", nargs="?", help="the task's key (or a filter below)")
        bulk.add_filters(p)
        if name == "retry":
            p.add_argument(
                "--from-step",
                metavar="NAME",
                help="keep the durable steps before NAME and run it and the rest again",
            )

    p = sub.add_parser("workers", help="list live workers")
    add_common(p)

    for name, text in (
        ("pause", "stop claiming a task name everywhere"),
        ("resume", "claim a paused task name again"),
    ):
        p = sub.add_parser(name, help=text)
        add_common(p)
        p.add_argument("name", help="the task name")
