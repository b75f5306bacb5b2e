"""A task's live output read from Node.js with the ``eventsource`` npm package (the WHATWG
``EventSource``): 300 of 1,000 chunks, then a new connection with ``Last-Event-ID`` gets the
rest exactly once, then ``end``."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from harness import node, worker_process
from needs import missing
from webserver import serving

from mtask import TaskClient

TOKEN = "node-token"
INTEROP = Path(__file__).parent / "interop"
SCRIPT = INTEROP / "eventsource.mjs"


def needs_eventsource() -> None:
    if not (INTEROP / "node_modules" / "eventsource").is_dir():
        missing("run `npm ci --prefix tests/acceptance/interop` for the eventsource package")


async def read(binary: str, base: str, count: int, *last: str) -> list[dict[str, Any]]:
    proc = await asyncio.create_subprocess_exec(
        binary, str(SCRIPT), base, TOKEN, "z", str(count), *last, stdout=asyncio.subprocess.PIPE
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 0, out
    lines = out.decode().splitlines()
    assert lines[0] == "open", lines[:3]
    return [json.loads(line) for line in lines[1:]]


async def test_a_node_event_source_resumes_with_last_event_id(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    binary = node()
    needs_eventsource()
    client.publish("chatter", "z", {"count": 1000, "every_ms": 4})
    with (
        worker_process(mongo_uri, db_name, "--concurrency", "1"),
        serving(mongo_uri, db_name, token=TOKEN) as base,
    ):
        first = await read(binary, base, 300)
        assert [e["data"]["data"]["i"] for e in first] == list(range(1, 301))
        rest = await read(binary, base, 0, first[-1]["id"])
    assert rest[-1] == {"end": {"status": "succeeded"}}
    chunks = rest[:-1]
    assert [e["data"]["data"]["i"] for e in chunks] == list(range(301, 1001))  # exactly once
    ids = [int(e["id"]) for e in chunks]
    assert ids == sorted(set(ids)) and ids[0] > int(first[-1]["id"])
