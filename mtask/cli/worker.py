"""``mtask-worker module:registry`` (also ``mtask worker run module:registry``): run a worker
process until SIGTERM/SIGINT; and ``mtask worker stop ID``, which asks a running worker to drain.

Signal handlers are installed by ``stop_on_signals``, a context manager that restores the
previous handlers on exit: the first signal drains (``grace``), a second one stops at once.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import signal
import sys
from collections.abc import Callable, Coroutine, Iterator, Sequence
from types import FrameType
from typing import TYPE_CHECKING, Any

from mtask._version import __version__
from mtask.cli.common import (
    Commands,
    add_common,
    add_connection,
    err,
    mongodb_uri,
    out,
    task_client,
)
from mtask.errors import (
    MtaskError,
    UsageError,
    WorkerCrashed,
    WorkerNotFound,
)

if TYPE_CHECKING:
    import asyncio

    from mtask.worker import Worker

commands = Commands()
run = commands.run


def _prefetch(value: str) -> int | str:
    if value == "auto":
        return value
    try:
        number = int(value)
    except ValueError:
        number = -1
    if number < 0:
        raise argparse.ArgumentTypeError(f"expected auto or a number not below 0, got {value!r}")
    return number


@contextlib.contextmanager
def stop_on_signals(worker: Worker, loop: asyncio.AbstractEventLoop) -> Iterator[None]:
    """First SIGTERM/SIGINT: graceful stop. Second: immediate. Old handlers restored after."""
    received = 0

    def handle(signum: int, frame: FrameType | None) -> None:
        nonlocal received
        received += 1
        loop.call_soon_threadsafe(worker.stop, received > 1)

    previous: dict[int, Any] = {}
    for sig in (signal.SIGTERM, signal.SIGINT):
        previous[sig] = signal.signal(sig, handle)
    try:
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)


def add_worker_options(p: argparse.ArgumentParser) -> None:
    """The options of ``mtask-worker``, shared with ``mtask worker run``."""
    p.add_argument("registry", help="module:attribute of an mtask.Registry")
    add_connection(p)
    add_run_options(p)
    p.add_argument("--version", action="version", version=f"mtask-worker {__version__}")


def add_run_options(p: argparse.ArgumentParser, *, names: bool = True) -> None:
    """How a worker runs, whatever its registry and its MongoDB: the options of
    ``mtask-worker`` but the registry, the connection and ``--version`` (shared with
    ``manage.py mtask_worker``, whose queues replace ``--names``: ``names=False``)."""
    p.add_argument(
        "--concurrency", type=int, default=10, metavar="N", help="runs at once (default 10)"
    )
    p.add_argument(
        "--prefetch",
        type=_prefetch,
        default="auto",
        metavar="auto|N",
        help="runs claimed ahead of a free slot, waiting for one; hides the claim round trip "
        "between short tasks. auto (default): up to --concurrency while runs are shorter than "
        "a claim's round trip and no name it runs is under a cluster-wide limit, a run that "
        "waited 1 s for its slot given back; N: always up to N (e.g. CPU-bound tasks in --pool "
        "process); 0: never",
    )
    if names:
        p.add_argument("--names", help="comma-separated task names (default: all registered)")
    p.add_argument("--worker-id", metavar="ID", help="its id (default: host:pid:random)")
    p.add_argument("--grace", type=float, default=30.0, help="seconds to drain on stop")
    p.add_argument(
        "--sweep-interval",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="how often it looks for work its change stream may have missed (default 30)",
    )
    p.add_argument(
        "--limits-refresh",
        type=float,
        metavar="SECONDS",
        help="read every cluster-wide limit this often whatever happens, the safety net for a "
        "lost change event (a change applies on its event; default 5 with --stream own, 30 "
        "with shared)",
    )
    p.add_argument(
        "--priority-aging",
        type=float,
        metavar="SECONDS",
        help="raise a waiting task's priority by one for every SECONDS it has waited, so "
        "low-priority work is not starved (default: strict priorities; give every worker "
        "the same value)",
    )
    p.add_argument(
        "--startup-timeout",
        type=float,
        default=60.0,
        help="seconds to keep trying to reach MongoDB at start before exiting (status 1)",
    )
    p.add_argument(
        "--no-schedules",
        action="store_true",
        help="do not publish the ticks of schedules (another worker does)",
    )
    p.add_argument(
        "--no-triggers",
        action="store_true",
        help="do not follow the registry's triggers and waited-on collections (other workers "
        "do: docs/triggers.md)",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        help="serve Prometheus metrics on /metrics, and /healthz and /readyz, on this port",
    )
    p.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        help="the address --metrics-port listens on (default 127.0.0.1; 0.0.0.0 in a container)",
    )
    p.add_argument(
        "--cluster-metrics",
        action="store_true",
        help="also export the cluster-wide gauges (queue depth, due tasks): in ONE process "
        "per cluster, and only if mtask serve does not (it exports them)",
    )
    p.add_argument(
        "--stream",
        choices=["own", "shared"],
        default="shared",
        help="shared (default): every worker, on any host, shares one change stream and one "
        "claim queue (held by one of them, chosen through MongoDB), and each task goes to one "
        "worker; own: each its own",
    )
    # -- handler isolation --
    p.add_argument(
        "--pool",
        choices=["thread", "process"],
        default="thread",
        help="where plain-def handlers run unless they declare isolation= (default: thread)",
    )
    p.add_argument(
        "--max-tasks-per-child", type=int, help="recycle a pool child after this many runs"
    )
    p.add_argument(
        "--max-memory-per-child",
        type=int,
        help="recycle a pool child whose resident memory after a run exceeds this many KiB "
        "(soft, as Celery's)",
    )
    p.add_argument(
        "--memory-limit-per-child",
        type=int,
        help="kill a busy pool child whose resident memory passes this many KiB (hard): its "
        "run fails with 'memory limit exceeded'",
    )
    p.add_argument(
        "--loop",
        choices=["auto", "asyncio", "uvloop"],
        default="auto",
        help="the event loop: auto (default) is uvloop where it is installed (a dependency on "
        "Linux and macOS), else asyncio's own",
    )
    p.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="the lowest level logged, on stderr",
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mtask-worker", description="Run an mtask worker.")
    add_worker_options(p)
    return p


def register(sub: Any) -> None:
    p = sub.add_parser("worker", help="run a worker, or stop one")
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    add_worker_options(actions.add_parser("run", help="run a worker (same as mtask-worker)"))
    stop = actions.add_parser("stop", help="ask a running worker to drain and exit")
    add_common(stop)
    stop.add_argument("worker_id", help="the worker's id, as mtask workers lists it")


@commands.command("worker")
def cmd_worker(args: argparse.Namespace) -> int:
    if args.action == "run":
        return run_worker(args)
    with task_client(args) as client:
        found = client.stop_worker(args.worker_id)
    if not found:
        raise WorkerNotFound(args.worker_id)
    said = f"stop requested: {args.worker_id} drains and exits at its next heartbeat"
    out.print(said, markup=False)
    return 0


def serve_metrics(args: argparse.Namespace, worker: Worker) -> None:
    """Prometheus metrics, ``/healthz`` and ``/readyz`` on ``--metrics-host:--metrics-port`` (a
    thread); with ``--cluster-metrics`` also the cluster-wide gauges, read through a client of
    their own (cached a few seconds)."""
    from mtask import metrics

    if args.cluster_metrics:
        from mtask.client import TaskClient

        client = TaskClient(args.uri, database=args.database, collection=args.collection)
        metrics.register_cluster_metrics(client)
    try:
        metrics.serve_http(args.metrics_host, args.metrics_port, lambda: worker.state)
    except OSError as exc:
        where = f"{args.metrics_host}:{args.metrics_port}"
        raise MtaskError(f"cannot serve metrics on {where}: {exc.strerror}") from None


def loop_factory(choice: str) -> tuple[str, Callable[[], asyncio.AbstractEventLoop] | None]:
    """The event loop ``--loop`` names, and what it is called: ``None`` is asyncio's own.

    uvloop runs the loop's own work (waking on a socket, handing a reply to the coroutine that
    awaits it) in C: each round trip of the driver's costs the worker less, and a task's wait
    with it (docs/journal/2026-11.md, "The worker on uvloop")."""
    if choice == "asyncio":
        return "asyncio", None
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise UsageError(
                "--loop uvloop: uvloop is not installed (pip install uvloop)"
            ) from None
        return "asyncio", None
    return f"uvloop {getattr(uvloop, '__version__', '')}".strip(), uvloop.new_event_loop


async def _serve(worker: Worker) -> None:
    import asyncio

    with stop_on_signals(worker, asyncio.get_running_loop()):
        await worker.run()


LEFT_BEHIND_WAIT = 1.0
"""How long the process, its worker stopped, waits for what is left on its event loop."""


def _run(
    main: Coroutine[Any, Any, None], new_loop: Callable[[], asyncio.AbstractEventLoop] | None
) -> None:
    """``asyncio.Runner.run``, whose close does not wait for ever: the worker has stopped
    without a run whose handler would not end (it swallows ``CancelledError``), and the
    Runner's close would wait for that task until it does."""
    import asyncio

    loop = (new_loop or asyncio.new_event_loop)()
    try:
        loop.run_until_complete(main)
    finally:
        try:
            left = asyncio.all_tasks(loop)
            for task in left:
                task.cancel()
            if left:
                loop.run_until_complete(asyncio.wait(left, timeout=LEFT_BEHIND_WAIT))
            if all(task.done() for task in left):  # else their generators are still running
                loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            loop.close()


def _log_handler() -> logging.Handler:
    """rich's handler on a terminal when the ``cli`` extra is there; one plain line per event
    otherwise (a file, a collector, a container's log)."""
    if sys.stderr.isatty() and err.rich_available:
        from rich.logging import RichHandler

        handler: logging.Handler = RichHandler(console=err.console, show_path=False)
        handler.setFormatter(logging.Formatter("%(message)s", datefmt="[%X]"))
        return handler
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    return handler


def _kib(value: int | None) -> int | None:
    return None if value is None else value * 1024


def build_worker(args: argparse.Namespace) -> Worker:
    """The worker ``args`` describe: the registry's module imported, then the worker's own."""
    from mtask.registry import load_registry

    registry = load_registry(args.registry)
    from mtask.worker import Worker

    return Worker(
        registry,
        uri=mongodb_uri(args.uri, "mtask-worker"),
        database=args.database,
        collection=args.collection,
        names=args.names.split(",") if args.names else None,
        **run_settings(args),
    )


def run_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The ``Worker`` keywords of ``add_run_options``'s options."""
    return dict(
        worker_id=args.worker_id,
        concurrency=args.concurrency,
        prefetch=args.prefetch,
        grace=args.grace,
        sweep_interval=args.sweep_interval,
        limits_refresh=args.limits_refresh,
        priority_aging=args.priority_aging,
        startup_timeout=args.startup_timeout,
        run_schedules=not args.no_schedules,
        run_triggers=not args.no_triggers,
        stream=args.stream,
        pool=args.pool,
        max_tasks_per_child=args.max_tasks_per_child,
        max_memory_per_child=_kib(args.max_memory_per_child),
        memory_limit_per_child=_kib(args.memory_limit_per_child),
    )


@contextlib.contextmanager
def lasting() -> Iterator[None]:
    """What is made inside (the modules imported, the registry, the worker's parts) lives as
    long as the process: the collector does not walk it while it grows (its passes were a
    tenth of a start-up's imports), and it is frozen once made (``gc.freeze``), so no
    later full collection walks it either. The collector is on again after, whatever
    happened."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
        gc.freeze()
    finally:
        if enabled:
            gc.enable()


def run_worker(
    args: argparse.Namespace,
    build: Callable[[argparse.Namespace], Worker] = build_worker,
    prog: str = "mtask-worker",
) -> int:
    """Run the worker ``build`` makes of ``args`` until it is stopped (``stop_on_signals``);
    its exit status: 0, 1 (a part of it died) or 2 (a usage or configuration error)."""
    logging.basicConfig(level=args.log_level, handlers=[_log_handler()])
    logging.getLogger("pymongo").setLevel(logging.WARNING)
    try:
        if args.cluster_metrics and args.metrics_port is None:
            raise UsageError("--cluster-metrics needs --metrics-port")
        with lasting():
            loop_name, new_loop = loop_factory(args.loop)
            worker = build(args)
            if args.metrics_port is not None:
                serve_metrics(args, worker)
        logging.getLogger("mtask.worker").info("event loop: %s", loop_name)
        _run(_serve(worker), new_loop)
    except WorkerCrashed as exc:
        err.print(f"{prog}: {exc}", markup=False)
        return 1
    except MtaskError as exc:
        err.print(f"{prog}: error: {exc}", markup=False)
        return 2
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``mtask-worker``."""
    return run_worker(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
