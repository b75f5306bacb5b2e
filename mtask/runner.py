"""``mtask-worker module:registry``: run a worker process until SIGTERM/SIGINT.

Signal handlers are installed by ``stop_on_signals``, a context manager that restores the
previous handlers on exit: the first signal drains (``grace``), a second one stops at once.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import logging
import signal
import sys
from collections.abc import Iterator, Sequence
from types import FrameType
from typing import Any

from rich.console import Console
from rich.logging import RichHandler

from mtask.errors import MtaskError
from mtask.registry import Registry
from mtask.worker import Worker, WorkerCrashed

err = Console(stderr=True, highlight=False, soft_wrap=True)


class RegistryNotFound(MtaskError):
    """The module:attribute given to mtask-worker is not a Registry."""


def load_registry(spec: str) -> Registry:
    module_name, _, attr = spec.partition(":")
    if not module_name:
        raise RegistryNotFound(f"expected module:registry, got {spec!r}")
    if "" not in sys.path and "." not in sys.path:
        sys.path.insert(0, "")  # like python -m: modules in the current directory
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise RegistryNotFound(f"cannot import {module_name!r}: {exc}") from None
    if attr:
        registry = getattr(module, attr, None)
    else:
        found = [v for v in vars(module).values() if isinstance(v, Registry)]
        registry = found[0] if len(found) == 1 else None
    if not isinstance(registry, Registry):
        raise RegistryNotFound(f"{spec!r} is not an mtask.Registry")
    return registry


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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mtask-worker", description="Run an mtask worker.")
    p.add_argument("registry", help="module:attribute of an mtask.Registry")
    p.add_argument("--uri", help="MongoDB URI (default: $MTASK_MONGODB_URI, else embedded)")
    p.add_argument("--database", default="mtask")
    p.add_argument("--collection", default="tasks")
    p.add_argument("--concurrency", type=int, default=10)
    p.add_argument("--names", help="comma-separated task names (default: all registered)")
    p.add_argument("--worker-id")
    p.add_argument("--grace", type=float, default=30.0, help="seconds to drain on stop")
    p.add_argument("--sweep-interval", type=float, default=30.0)
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
        "--metrics-port",
        type=int,
        help="serve Prometheus metrics (mtask_…) on this port, on every interface",
    )
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return p


def serve_metrics(port: int, uri: str | None, database: str, collection: str) -> None:
    """Prometheus metrics on ``port`` (a thread), with queue depth read through a client of
    its own (cached a few seconds)."""
    from prometheus_client import start_http_server

    from mtask import metrics
    from mtask.client import TaskClient

    client = TaskClient(uri, database=database, collection=collection)
    metrics.register_queue_depth(client.stats)
    try:
        start_http_server(port)
    except OSError as exc:
        raise MtaskError(f"cannot serve metrics on port {port}: {exc.strerror}") from None


async def _serve(worker: Worker) -> None:
    with stop_on_signals(worker, asyncio.get_running_loop()):
        await worker.run()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if sys.stderr.isatty():
        handler: logging.Handler = RichHandler(console=err, show_path=False)
        handler.setFormatter(logging.Formatter("%(message)s", datefmt="[%X]"))
    else:  # logs to a file or a collector: one plain line per event
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    logging.basicConfig(level=args.log_level, handlers=[handler])
    logging.getLogger("pymongo").setLevel(logging.WARNING)
    try:
        registry = load_registry(args.registry)
        worker = Worker(
            registry,
            uri=args.uri,
            database=args.database,
            collection=args.collection,
            worker_id=args.worker_id,
            concurrency=args.concurrency,
            names=args.names.split(",") if args.names else None,
            grace=args.grace,
            sweep_interval=args.sweep_interval,
            startup_timeout=args.startup_timeout,
            run_schedules=not args.no_schedules,
        )
        if args.metrics_port is not None:
            serve_metrics(args.metrics_port, args.uri, args.database, args.collection)
        asyncio.run(_serve(worker))
    except WorkerCrashed as exc:
        err.print(f"mtask-worker: {exc}", markup=False)
        return 1
    except MtaskError as exc:
        err.print(f"mtask-worker: error: {exc}", markup=False)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
