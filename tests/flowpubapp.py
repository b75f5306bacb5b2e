"""Handlers for flow control's publish/run side (snooze, supersede, batches): run by worker
processes (``mtask-worker flowpubapp:registry``) and importable by pool children."""

from __future__ import annotations

import time
from typing import Any

from mtask import BatchItem, Registry, Snooze, TaskContext

registry = Registry()


def _snooze(params: dict[str, Any], ctx: TaskContext) -> int:
    """Snoozes its first ``times`` runs for ``seconds`` each, then returns its attempt."""
    if ctx.attempt <= params["times"]:
        raise Snooze(params["seconds"], "upstream busy")
    return ctx.attempt


@registry.task("snoozer")
def snoozer(params: dict[str, Any], ctx: TaskContext) -> int:
    return _snooze(params, ctx)


@registry.task("snoozer_in_child", isolation="process")
def snoozer_in_child(params: dict[str, Any], ctx: TaskContext) -> int:
    return _snooze(params, ctx)


@registry.task("bad_snooze")
def bad_snooze(params: dict[str, Any]) -> None:
    exc = Snooze(1)
    exc.delay_ms = -5  # a changed delay skips the constructor's check: the run fails
    raise exc


@registry.task("hold")
def hold(params: dict[str, Any], ctx: TaskContext) -> str:
    """Runs until its run is told to stop (cancelled), then tries to succeed: a fenced run's
    SUCCESS must not land."""
    while not ctx.cancelled.is_set():
        time.sleep(0.02)
    return "finished after its stop"


@registry.task("collect")
def collect(params: dict[str, Any]) -> dict[str, Any]:
    return params


@registry.task("reindex")  # the name of docs/flow-control.md's foreign debounce update
def reindex(params: dict[str, Any]) -> dict[str, Any]:
    return params


@registry.task("wide", batch=100, batch_timeout=3600)
def wide(items: list[BatchItem]) -> list[Any]:
    """A batch larger than the worker's slots, with a timeout no test waits for."""
    return [{"size": len(items)} for _ in items]


@registry.task("index", batch=50, batch_timeout=0.2)
def index(items: list[BatchItem]) -> list[Any]:
    """A batch handler: one entry per item; an item asking to fail fails alone."""
    return [
        RuntimeError(f"bad {item.key}") if item.params.get("fail") else {"size": len(items)}
        for item in items
    ]
