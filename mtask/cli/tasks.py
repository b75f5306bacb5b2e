"""The task commands: ``publish`` (one task, or JSON lines with ``--from-file``), ``get``,
``list``, ``stats``, ``cancel``, ``retry``, ``workers``, ``pause`` and ``resume``."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from mtask.cli import bulk
from mtask.cli.common import (
    STATUSES,
    Choices,
    Commands,
    add_common,
    choose,
    err,
    out,
    parse_json_object,
    print_json,
    task_client,
)
from mtask.cli.render import (
    groups_table,
    print_list,
    print_published,
    print_task,
    print_tracebacks,
    state_counts_json,
    state_json,
    state_table,
    stats_table,
    workers_table,
)
from mtask.errors import TaskNotFound, UsageError

if TYPE_CHECKING:
    pass

# What the commands show (models, states, wording, tracebacks) is imported by the handler that
# shows it: building the parser (`mtask --help`) imports none of it.


def _on_conflict() -> tuple[str, ...]:
    from mtask.vocabulary import ON_CONFLICT_CHOICES

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


@commands.command("publish")
def cmd_publish(args: argparse.Namespace) -> int:
    if args.from_file is not None:
        from mtask.cli import from_file

        if args.name is not None or args.key is not None:
            raise UsageError("give NAME KEY or --from-file, not both")
        from_file.refuse_per_task_options(args)
        return from_file.publish_from_file(args)
    if args.name is None or args.key is None:
        raise UsageError("publish needs NAME and KEY (or --from-file FILE of JSON lines)")
    params = parse_json_object(args.params, "--params") if args.params else {}
    options = _options_from_args(args)
    with task_client(args) as client:
        if args.require_dependencies and args.depends_on:
            refuse_missing(client.missing(args.depends_on))
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
        said = None if args.json or result.dropped else client.explain(result.task)
    for key in result.missing_dependencies:
        err.print(
            f"mtask: warning: --depends-on {key}: no task has that key, so {args.key} waits "
            "until one is published and succeeds (--require-dependencies refuses such a publish)",
            markup=False,
        )
    if args.json:
        print_json(
            {
                "created": result.created,
                "updated": result.updated,
                "task": result.task.model_dump(by_alias=True),
                "superseded": result.superseded,
                "dropped": result.dropped,
                "missing_dependencies": result.missing_dependencies,
            }
        )
        return 0
    print_published(result, said)
    return 0


def refuse_missing(missing: list[str]) -> None:
    if missing:
        listed = ", ".join(missing)
        which = "that key" if len(missing) == 1 else "those keys"
        raise UsageError(
            f"--depends-on {listed}: no task has {which}"
            " (nothing was published: publish it first, or leave out --require-dependencies)"
        )


@commands.command("get")
def cmd_get(args: argparse.Namespace) -> int:
    with task_client(args, reads=True) as client:
        task = client.get(args.key)
        if task is None:
            raise TaskNotFound(args.key)
        said = client.explain(task)
        now = client.now()
    if args.json:
        from mtask.security.encryption import shown

        dumped = task.model_dump(by_alias=True)
        dumped["params"], dumped["result"] = shown(task.params), shown(task.result)
        print_json({**dumped, **state_json(said)})
    else:
        print_task(task, said, now)
        if args.traceback:
            print_tracebacks(task)
    return 0


@commands.command("list")
def cmd_list(args: argparse.Namespace) -> int:
    if args.state is not None and (args.status is not None or args.order != "newest"):
        raise UsageError("--state lists newest first, without --status or --order")
    with task_client(args, reads=True) as client:
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
        print_json([{**t.model_dump(by_alias=True), **state_json(e)} for t, e in rows])
        return 0
    print_list(rows, now)
    if more is not None and args.state is not None:
        out.print(f"more may match: --after {more}", markup=False)
    return 0


@commands.command("stats")
def cmd_stats(args: argparse.Namespace) -> int:
    if args.groups < 0:
        raise UsageError("--groups must not be negative")
    with task_client(args, reads=True) as client:
        split = client.state_counts(exact=args.exact) if args.by == "state" else None
        stored = client.stats(exact=args.exact) if split is None else split.stored
        groups = client.groups(top=args.groups) if args.groups else []
    if args.json:
        print_json(stored if split is None else state_counts_json(split))
        return 0
    if not stored:
        out.print(
            f"no tasks yet in {args.database}.{args.collection} (mtask publish NAME KEY "
            "publishes one)",
            markup=False,
        )
        return 0
    out.print(stats_table(stored) if split is None else state_table(split))
    if groups:
        out.print(groups_table(groups))
    return 0


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
    out.print(workers_table(workers))
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
    p.add_argument(
        "--require-dependencies",
        action="store_true",
        help="refuse the publish (exit 2, nothing written) if a --depends-on KEY names no task; "
        "without it such a publish warns",
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

    p = sub.add_parser("stats", help="counts per name and state")
    add_common(p)
    p.add_argument(
        "--by",
        choices=["state", "status"],
        default="state",
        help="count by derived state, as list, get and the dashboard say it (default), or by "
        "stored status",
    )
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
