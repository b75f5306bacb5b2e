"""The ``mtask`` command line.

Every command takes ``--uri`` (else ``MTASK_MONGODB_URI``, else the embedded server),
``--database`` and ``--collection``. Bad input prints one clear line on stderr and exits 2;
MongoDB trouble exits 1; nothing prints a traceback for a user's mistake.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

from mtask.errors import InvalidTask, InvalidTransition, MtaskError, TaskNotFound
from mtask.models import Task, TaskStatus

EXIT_USAGE = 2
out = Console(highlight=False)
err = Console(stderr=True, highlight=False, soft_wrap=True)

Handler = Callable[[argparse.Namespace], int]
COMMANDS: dict[str, Handler] = {}


class UsageError(MtaskError):
    """The command line itself is wrong (bad JSON, bad option value)."""


def command(name: str) -> Callable[[Handler], Handler]:
    def register(fn: Handler) -> Handler:
        COMMANDS[name] = fn
        return fn

    return register


def parse_json_object(text: str, what: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"{what} is not valid JSON: {exc.msg} at position {exc.pos}") from None
    if not isinstance(value, dict):
        raise UsageError(f"{what} must be a JSON object, not {type(value).__name__}")
    return value


def _json_default(value: Any) -> Any:
    if isinstance(value, dt.datetime):
        return value.isoformat()
    return str(value)


def print_json(value: Any) -> None:
    sys.stdout.write(json.dumps(value, default=_json_default, indent=2) + "\n")


def _when(value: dt.datetime | None) -> str:
    return value.strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] if value else "-"


def _task_client(args: argparse.Namespace) -> Any:
    from mtask.client import TaskClient

    return TaskClient(args.uri, database=args.database, collection=args.collection)


# ---------------------------------------------------------------------------------------------
# Task commands
# ---------------------------------------------------------------------------------------------


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


@command("publish")
def cmd_publish(args: argparse.Namespace) -> int:
    if args.from_file is not None:
        if args.name is not None or args.key is not None:
            raise UsageError("give NAME KEY or --from-file, not both")
        from mtask.cli_live import publish_from_file

        return publish_from_file(args)
    if args.name is None or args.key is None:
        raise UsageError("publish needs NAME and KEY (or --from-file FILE of JSON lines)")
    params = parse_json_object(args.params, "--params") if args.params else {}
    options = _options_from_args(args)
    with _task_client(args) as client:
        result = client.publish(
            args.name,
            args.key,
            params,
            options=options,
            delay=args.delay,
            on_conflict=args.on_conflict,
            depends_on=args.depends_on,
        )
    if args.json:
        print_json(
            {
                "created": result.created,
                "updated": result.updated,
                "task": result.task.model_dump(by_alias=True),
            }
        )
    else:
        what = "created" if result.created else ("updated" if result.updated else "exists")
        out.print(f"{what}: {result.task.key} ({result.task.name}, {result.task.status})")
    return 0


@command("get")
def cmd_get(args: argparse.Namespace) -> int:
    with _task_client(args) as client:
        task = client.get(args.key)
    if task is None:
        raise TaskNotFound(args.key)
    if args.json:
        print_json(task.model_dump(by_alias=True))
    else:
        print_task(task)
    return 0


def print_task(task: Task) -> None:
    grid = Table.grid(padding=(0, 2))
    for label, value in [
        ("key", task.key),
        ("name", task.name),
        ("status", task.status.value),
        ("params", json.dumps(task.params, default=_json_default)),
        ("attempts", f"{task.attempts} (successes {task.successes}, failures {task.failures})"),
        ("next claim", _when(task.next_claim_at)),
        ("created", _when(task.created_at)),
        ("finished", _when(task.finished_at)),
        ("error", task.error or "-"),
        ("result", json.dumps(task.result, default=_json_default)),
        *_flow_rows(task),
    ]:
        grid.add_row(f"[bold]{label}[/]", value)
    out.print(grid)
    if task.runs:
        runs = Table("run", "worker", "state", "claimed", "lease / finished", "error")
        for run in task.runs:
            runs.add_row(
                run.run_id[:8],
                run.worker_id,
                run.state.value,
                _when(run.claimed_at),
                _when(run.finished_at or run.lease_expires_at),
                run.error or "",
            )
        out.print(runs)


def _flow_rows(task: Task) -> list[tuple[str, str]]:
    rows = []
    if task.parent:
        rows.append(("parent", task.parent))
    if task.children:
        rows.append(("children", ", ".join(task.children)))
    if task.depends_on:
        waiting = f" (waiting on {', '.join(task.waiting_on)})" if task.waiting_on else ""
        rows.append(("depends on", ", ".join(task.depends_on) + waiting))
    return rows


@command("list")
def cmd_list(args: argparse.Namespace) -> int:
    with _task_client(args) as client:
        tasks = client.list(
            name=args.name, status=args.status, limit=args.limit, after=args.after, order=args.order
        )
    if args.json:
        print_json([t.model_dump(by_alias=True) for t in tasks])
        return 0
    table = Table("key", "name", "status", "attempts", "next claim", "created")
    for t in tasks:
        table.add_row(
            t.key,
            t.name,
            t.status.value,
            str(t.attempts),
            _when(t.next_claim_at),
            _when(t.created_at),
        )
    out.print(table)
    return 0


@command("stats")
def cmd_stats(args: argparse.Namespace) -> int:
    with _task_client(args) as client:
        counts = client.stats()
    if args.json:
        print_json(counts)
        return 0
    statuses = [s.value for s in TaskStatus]
    table = Table("name", *statuses, "total")
    for name in sorted(counts):
        row = counts[name]
        table.add_row(name, *(str(row.get(s, 0)) for s in statuses), str(sum(row.values())))
    out.print(table)
    return 0


@command("cancel")
def cmd_cancel(args: argparse.Namespace) -> int:
    with _task_client(args) as client:
        task = client.cancel(args.key)
    out.print(f"cancelled: {task.key}")
    return 0


@command("retry")
def cmd_retry(args: argparse.Namespace) -> int:
    with _task_client(args) as client:
        task = client.retry(args.key)
    out.print(f"pending again: {task.key}")
    return 0


# ---------------------------------------------------------------------------------------------
# Workers and names
# ---------------------------------------------------------------------------------------------


@command("workers")
def cmd_workers(args: argparse.Namespace) -> int:
    with _task_client(args) as client:
        workers = client.workers()
    if args.json:
        print_json(workers)
        return 0
    table = Table("worker", "names", "in flight", "concurrency", "state", "started", "last seen")
    for w in workers:
        table.add_row(
            w["_id"],
            ",".join(w.get("names", [])),
            str(w.get("in_flight", 0)),
            str(w.get("concurrency", "")),
            str(w.get("state", "")),
            _when(w.get("started_at")),
            _when(w.get("last_seen")),
        )
    out.print(table)
    return 0


@command("worker")
def cmd_worker(args: argparse.Namespace) -> int:
    with _task_client(args) as client:
        found = client.stop_worker(args.worker_id)
    if not found:
        raise UsageError(f"no worker {args.worker_id!r} is registered (see `mtask workers`)")
    out.print(f"stop requested: {args.worker_id} drains and exits at its next heartbeat")
    return 0


@command("pause")
def cmd_pause(args: argparse.Namespace) -> int:
    with _task_client(args) as client:
        client.pause(args.name)
    out.print(f"paused: {args.name} (no worker claims it until `mtask resume {args.name}`)")
    return 0


@command("resume")
def cmd_resume(args: argparse.Namespace) -> int:
    with _task_client(args) as client:
        client.resume(args.name)
    out.print(f"resumed: {args.name}")
    return 0


@command("serve")
def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from mtask.web import create_app
    from mtask.web.auth import AuthConfigError, check_bind, load_token

    try:
        token = load_token(args.token_file)
        check_bind(args.host, token)
    except AuthConfigError as exc:
        raise UsageError(str(exc)) from None
    app = create_app(args.uri, database=args.database, collection=args.collection, token=token)
    auth = "bearer token required" if token else "no token (loopback only)"
    err.print(f"mtask serve: http://{args.host}:{args.port}/ ({auth})", markup=False)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


@command("completion")
def cmd_completion(args: argparse.Namespace) -> int:
    import shtab

    sys.stdout.write(shtab.complete(build_parser(), shell=args.shell))
    return 0


@command("demo")
def cmd_demo(args: argparse.Namespace) -> int:
    from mtask.demo import run_demo

    return run_demo(args.uri, seconds=args.seconds)


# ---------------------------------------------------------------------------------------------
# Embedded MongoDB
# ---------------------------------------------------------------------------------------------


@command("mongod")
def cmd_mongod(args: argparse.Namespace) -> int:
    from mtask.embedded import EmbeddedMongo

    server = EmbeddedMongo(args.data_dir, port=args.port)
    if args.action == "start":
        print(server.start())
        return 0
    if args.action == "stop":
        out.print("stopped" if server.stop() else "not running")
        return 0
    status = server.status()
    if args.json:
        print_json(
            {
                "running": status.running,
                "pid": status.pid,
                "port": status.port,
                "uri": status.uri,
                "data_dir": str(status.data_dir),
            }
        )
    elif status.running:
        out.print(f"running: pid {status.pid}, {status.uri} (data in {status.data_dir})")
    else:
        out.print(f"not running (data in {status.data_dir})")
    return 0 if status.running else 3


# ---------------------------------------------------------------------------------------------
# Parser
# ---------------------------------------------------------------------------------------------


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--uri", help="MongoDB URI (default: $MTASK_MONGODB_URI, else embedded)")
    p.add_argument("--database", default="mtask")
    p.add_argument("--collection", default="tasks")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mtask", description="MongoDB-backed task service.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("publish", help="publish a task (idempotent by key)")
    _common(p)
    p.add_argument("name", nargs="?")
    p.add_argument("key", nargs="?")
    p.add_argument(
        "--from-file",
        metavar="FILE",
        help="publish JSON lines ({name, key, params, options, delay, depends_on}); - for stdin",
    )
    p.add_argument("--params", help="JSON object")
    p.add_argument("--options", help="JSON object of task options")
    p.add_argument("--priority", type=int)
    p.add_argument("--concurrency", type=int)
    p.add_argument("--max-retries", type=int)
    p.add_argument("--worker-timeout-ms", type=int)
    p.add_argument("--ping-interval-ms", type=int)
    p.add_argument("--worker", action="append", help="only this worker id may run it (repeat)")
    p.add_argument("--delay", type=float, help="seconds before it may run")
    p.add_argument("--on-conflict", default="ignore", choices=["ignore", "update_params", "reset"])
    p.add_argument(
        "--depends-on", action="append", help="run only after this task succeeded (repeat)"
    )

    p = sub.add_parser("get", help="show one task")
    _common(p)
    p.add_argument("key")

    p = sub.add_parser("list", help="list tasks")
    _common(p)
    p.add_argument("--name")
    p.add_argument("--status", choices=[s.value for s in TaskStatus])
    p.add_argument("--limit", type=int, default=50)
    p.add_argument("--after", help="last key of the previous page")
    p.add_argument("--order", choices=["newest", "next_claim_at"], default="newest")

    p = sub.add_parser("stats", help="counts per name and status")
    _common(p)

    for name, text in (("cancel", "cancel a task"), ("retry", "run a failed/cancelled task again")):
        p = sub.add_parser(name, help=text)
        _common(p)
        p.add_argument("key")

    p = sub.add_parser("workers", help="list live workers")
    _common(p)

    p = sub.add_parser("worker", help="control a worker")
    _common(p)
    p.add_argument("action", choices=["stop"])
    p.add_argument("worker_id")

    for name, text in (
        ("pause", "stop claiming a task name everywhere"),
        ("resume", "claim a paused task name again"),
    ):
        p = sub.add_parser(name, help=text)
        _common(p)
        p.add_argument("name")

    from mtask import cli_live, cli_scheduling

    cli_scheduling.add_parsers(sub)
    cli_live.add_parsers(sub)

    p = sub.add_parser("serve", help="the REST API, dashboard and metrics over HTTP")
    p.add_argument("--uri", help="MongoDB URI (default: $MTASK_MONGODB_URI, else embedded)")
    p.add_argument("--database", default="mtask")
    p.add_argument("--collection", default="tasks")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--token-file", help="a file holding the API token (else $MTASK_API_TOKEN)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])

    p = sub.add_parser("completion", help="print a shell completion script")
    p.add_argument("shell", choices=["bash", "zsh", "tcsh"])

    p = sub.add_parser("demo", help="sample tasks, three workers, one killed mid-run")
    p.add_argument("--uri", help="MongoDB URI (default: $MTASK_MONGODB_URI, else embedded)")
    p.add_argument("--seconds", type=float, default=120.0, help="give up after this long")

    sub.add_parser("bench", help="the benchmark suite (see `mtask bench --help`)")

    p = sub.add_parser("mongod", help="the embedded MongoDB: start, stop, status")
    p.add_argument("action", choices=["start", "stop", "status"])
    p.add_argument("--data-dir", help="default ./.mtask/mongodb or $MTASK_DATA_DIR")
    p.add_argument("--port", type=int)
    p.add_argument("--json", action="store_true")
    return parser


def run_command(handler: Handler, args: argparse.Namespace) -> int:
    """Run a handler, turning mtask's errors into one line on stderr and an exit status."""
    try:
        return handler(args)
    except (UsageError, InvalidTask) as exc:
        err.print(f"mtask: error: {exc}", markup=False)
        return EXIT_USAGE
    except (TaskNotFound, InvalidTransition) as exc:
        err.print(f"mtask: {exc}", markup=False)
        return 1
    except MtaskError as exc:
        err.print(f"mtask: {exc}", markup=False)
        return 1
    except KeyboardInterrupt:
        return 130


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:  # the benchmark suite has its own options
        from mtask.bench import main as bench_main

        return bench_main(argv[1:])
    args = build_parser().parse_args(argv)
    return run_command(COMMANDS[args.command], args)


def worker_main(argv: Sequence[str] | None = None) -> int:
    from mtask.runner import main as run_worker

    return run_worker(argv)


if __name__ == "__main__":
    sys.exit(main())
