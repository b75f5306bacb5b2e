"""A worker's configuration: the keyword arguments of ``Worker``, checked in one place."""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from mtask.clock import Clock
from mtask.errors import ConfigError
from mtask.registry import Registry

DEFAULT_MAX_RESULT_BYTES = 1024 * 1024


def default_worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


@dataclass(frozen=True)
class WorkerConfig:
    uri: str | None = None
    database: str = "mtask"
    collection: str = "tasks"
    worker_id: str | None = None
    """``host:pid:random`` when not given."""
    concurrency: int = 10
    """Handlers running at once."""
    prefetch: int | Literal["auto"] = "auto"
    """Runs claimed beyond ``concurrency``, each waiting for a free slot (Celery's prefetch):
    the next run is claimed while the slots are busy, so a slot that frees does not wait a
    claim round trip. They hold leases (pinged) while they wait. ``"auto"``: up to
    ``concurrency`` ahead while runs are shorter than a claim's round trip, and a run that
    waited a second for its slot is given back (RELEASED); ``N``: always up to N ahead, each
    waiting as long as it takes; ``0``: never (``mtask.worker.claiming.ahead``)."""
    names: Sequence[str] | None = None
    """The names to run (all the registry's when not given)."""
    grace: float = 30.0
    """Seconds a stopping worker waits for its runs before it cancels and releases them."""
    sweep_interval: float = 30.0
    limits_refresh: float | None = None
    """Seconds between two reads of every limit whatever happens: the safety net for a lost
    change event (a change applies on its event, within a second). ``None``: 5 s with an own
    stream, 30 s with the shared one."""
    flow_sweep_interval: float = 5.0
    run_schedules: bool = True
    run_triggers: bool = True
    """Follow the registry's triggers and the collections its tasks wait on (one worker of the
    cluster holds each: docs/triggers.md)."""
    startup_timeout: float = 60.0
    heartbeat_interval: float = 2.0
    stream: Literal["own", "shared"] = "shared"
    """``shared``: every worker of the tasks collection, on any host, shares one change
    stream and one claim queue, held by one of them, which hands each task to one worker
    (``finding.shared``; docs/finding-work.md);
    ``own``: this worker's own change stream and queue."""
    stagger_ms: float = 25.0
    queue_size: int = 10_000
    priority_aging: float | None = None
    """Seconds of waiting that raise a due task's priority by one when choosing what to claim
    (and, for the relay's holder, what to hand out), so low-priority work is not starved for
    ever; ``None``: strict priorities. Give every worker the same value
    (docs/flow-control.md)."""
    max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES
    clock: Clock | None = None
    on_event: Callable[..., None] | None = None
    # -- handler isolation --
    pool: Literal["thread", "process"] = "thread"
    """Where plain-def handlers that declare no ``isolation`` run."""
    max_tasks_per_child: int | None = None
    max_memory_per_child: int | None = None
    """Bytes of resident memory after a run past which a pool child is recycled (soft)."""
    memory_limit_per_child: int | None = None
    """Bytes of resident memory past which a busy pool child is killed at once (hard): its
    run fails with ``memory limit exceeded``."""

    def chosen_names(self, registry: Registry) -> list[str]:
        """The names this worker runs; raises ``ConfigError`` for a bad configuration."""
        if self.concurrency < 1:
            raise ConfigError("must be at least 1", field="concurrency")
        prefetch = self.prefetch
        if prefetch != "auto" and (
            isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0
        ):
            raise ConfigError('must be "auto" or a number not below 0', field="prefetch")
        if self.grace < 0:
            raise ConfigError("must not be negative", field="grace")
        if self.stream not in ("own", "shared"):
            raise ConfigError("must be own or shared", field="stream")
        if self.pool not in ("thread", "process"):
            raise ConfigError("must be thread or process", field="pool")
        _within(self.priority_aging, 1, "priority_aging")
        _within(self.limits_refresh, 0.1, "limits_refresh")
        if self.memory_limit_per_child is not None and self.memory_limit_per_child < 1:
            raise ConfigError("must be at least 1", field="memory_limit_per_child")
        chosen = list(self.names) if self.names else registry.names
        unknown = [n for n in chosen if n not in registry]
        if unknown:
            raise ConfigError(f"no handler registered for {', '.join(unknown)}", field="names")
        if not chosen:
            raise ConfigError("the registry has no handlers", field="registry")
        return chosen


def _within(seconds: float | None, least: float, field: str) -> None:
    """An interval, if given, is from ``least`` to a day."""
    if seconds is not None and not least <= seconds <= 86_400:
        raise ConfigError(f"must be from {least:g} to 86400 seconds", field=field)
