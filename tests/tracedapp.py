"""A workflow traced by real worker processes: this module sets an OpenTelemetry SDK whose
exporter writes each ended span as a JSON line to ``<MTASK_SPANS_DIR>/<pid>.jsonl`` (one file
a process: a worker killed with SIGKILL keeps every span it ended). ``traced_parent`` has
three steps (the second waits to be let go: ``release``), a sleep, two parallel branches and
three children; ``CHAOS_URI``/``CHAOS_DB`` name its database."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult
from pymongo import AsyncMongoClient

from mtask import Registry, TaskContext
from mtask.steps.children import Spawn


def _id(value: int) -> str:
    return format(value, "016x")


class JsonLines(SpanExporter):
    """Each span as one JSON line, written and flushed as it ends."""

    def __init__(self, path: Path) -> None:
        self.file = path.open("a", encoding="utf-8")

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        for span in spans:
            ctx, parent = span.get_span_context(), span.parent
            line = {
                "name": span.name,
                "trace_id": format(ctx.trace_id, "032x"),
                "span_id": _id(ctx.span_id),
                "parent_id": _id(parent.span_id) if parent is not None else None,
                "attributes": dict(span.attributes or {}),
                "links": [
                    {
                        "trace_id": format(link.context.trace_id, "032x"),
                        "span_id": _id(link.context.span_id),
                        "attributes": dict(link.attributes or {}),
                    }
                    for link in span.links
                ],
                "status": span.status.status_code.name,
            }
            self.file.write(json.dumps(line) + "\n")
        self.file.flush()
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        self.file.close()


_provider = TracerProvider()
_provider.add_span_processor(
    SimpleSpanProcessor(JsonLines(Path(os.environ["MTASK_SPANS_DIR"]) / f"{os.getpid()}.jsonl"))
)
trace.set_tracer_provider(_provider)

registry = Registry()
LEASE = {"worker_timeout_ms": 3000, "ping_interval_ms": 500}
_clients: dict[str, Any] = {}


def _db() -> Any:
    if "c" not in _clients:
        _clients["c"] = AsyncMongoClient(os.environ["CHAOS_URI"], tz_aware=True)
    return _clients["c"][os.environ["CHAOS_DB"]]


@registry.task("traced_parent")
async def traced_parent(params: dict[str, Any], ctx: TaskContext) -> list[Any]:
    async def gate() -> int:
        await _db()["calls"].insert_one({"key": ctx.key, "step": "b"})
        while not await _db()["release"].find_one({"_id": ctx.key}):  # noqa: ASYNC110
            await asyncio.sleep(0.05)  # the first run is killed while it waits here
        return 2

    async def part(name: str) -> str:
        return name.upper()

    a = await ctx.step("a", lambda: 1)
    b = await ctx.step("b", gate)
    await ctx.sleep(0.3, name="nap")
    parts = await ctx.gather(ctx.step("p1", part, "p1"), ctx.step("p2", part, "p2"))
    kids = [Spawn("traced_child", {"n": n}, options=LEASE) for n in range(3)]
    results = await ctx.spawn_and_wait(kids, name="kids")
    c = await ctx.step("c", lambda: 3)
    return [a, b, *parts, *results, c]


@registry.task("traced_child")
async def traced_child(params: dict[str, Any], ctx: TaskContext) -> int:
    return int(await ctx.step("work", lambda: params["n"] * 10))


@registry.task("traced_isolated", isolation="process")
def traced_isolated(params: dict[str, Any], ctx: TaskContext) -> int:
    """Its steps run in a child process of the worker's pool."""
    return int(ctx.step_sync("one", lambda: 1)) + int(ctx.step_sync("two", lambda: 2))
