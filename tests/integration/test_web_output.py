"""A task's live output over HTTP (docs/output.md): ``GET /tasks/{key}:output`` and the SSE
stream ``GET /tasks/{key}:stream``, resumed with ``Last-Event-ID`` exactly once; auth, bad
input, a missing task; the dashboard's task page shows the progress and the newest lines."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx2 as httpx
import pytest
from harness import running_worker
from webserver import serving

from mtask import AsyncTaskClient, TaskClient
from mtask.registry import Registry, TaskContext

TOKEN = "test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
registry = Registry()
RELEASE: dict[str, asyncio.Event] = {}


@registry.task("chunks")
async def chunks(params: dict[str, int], ctx: TaskContext) -> int:
    ctx.log.info("starting", n=params["n"])
    for i in range(1, params["n"] + 1):
        ctx.emit(f"c{i}")
        ctx.progress(i / params["n"], f"chunk {i} of {params['n']}")
        if i % 10 == 0:
            await asyncio.sleep(0.002)
        if i == params.get("pause_at"):
            await RELEASE[ctx.key].wait()
    return params["n"]


@pytest.fixture
def base(mongo_uri: str, db_name: str) -> Iterator[str]:
    with serving(mongo_uri, db_name, token=TOKEN) as url:
        yield url


def read_stream(
    base: str, key: str, stop_after: int | None, headers: dict[str, str], params: dict[str, Any]
) -> list[dict[str, Any]]:
    """The stream's frames (``event``, ``id``, ``data``) until ``end`` or ``stop_after`` chunks."""
    frames: list[dict[str, Any]] = []
    with httpx.stream(
        "GET", f"{base}/tasks/{key}:stream", params=params, headers={**AUTH, **headers},
        timeout=60,
    ) as response:  # fmt: skip
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        block: dict[str, str] = {}
        for line in response.iter_lines():
            if line == "":
                if "event" in block:
                    frames.append({**block, "data": json.loads(block["data"])})
                    if block["event"] == "end":
                        return frames
                    chunks = [f for f in frames if f["event"] == "chunk"]
                    if stop_after is not None and len(chunks) == stop_after:
                        return frames  # the client goes away mid-stream
                block = {}
            elif not line.startswith(":"):
                field, _, value = line.partition(":")
                block[field] = value.removeprefix(" ")
    raise AssertionError(f"the stream ended without 'end' after {len(frames)} frames")


async def test_sse_resumes_with_last_event_id_exactly_once(
    base: str, mongo_uri: str, db_name: str, aclient: AsyncTaskClient
) -> None:
    RELEASE["s"] = asyncio.Event()
    async with running_worker(registry, mongo_uri, db_name) as (_, events):
        await aclient.publish("chunks", "s", {"n": 1000, "pause_at": 500})
        first = await asyncio.to_thread(read_stream, base, "s", 300, {}, {"kind": "chunk"})
        assert [f["data"]["data"] for f in first] == [f"c{i}" for i in range(1, 301)]
        last = first[-1]["id"]
        RELEASE["s"].set()
        rest = await asyncio.to_thread(
            read_stream, base, "s", None, {"Last-Event-ID": last}, {"kind": "chunk"}
        )
        await events.wait("recorded", key="s")
    assert rest[-1] == {"event": "end", "data": {"status": "succeeded"}}
    data = [f["data"]["data"] for f in rest[:-1]]
    assert data == [f"c{i}" for i in range(301, 1001)]  # none lost, none twice
    assert [int(f["id"]) for f in rest[:-1]] == [f["data"]["seq"] for f in rest[:-1]]
    both = await asyncio.to_thread(read_stream, base, "s", None, {}, {})  # a finished task
    assert [f["event"] for f in both][:2] == ["log", "chunk"] and both[-1]["event"] == "end"


def test_output_pages_auth_and_bad_input(
    base: str, mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    async def work() -> None:
        async with running_worker(registry, mongo_uri, db_name) as (_, events):
            client.publish("chunks", "img/1", {"n": 30})
            await events.wait("recorded", key="img/1")

    asyncio.run(work())
    page = httpx.get(f"{base}/tasks/img/1:output", params={"after": 5, "limit": 10}, headers=AUTH)
    assert page.status_code == 200
    body = page.json()
    assert [e["seq"] for e in body["entries"]] == list(range(6, 16)) and body["last"] == 15
    logs = httpx.get(f"{base}/tasks/img/1:output", params={"kind": "log"}, headers=AUTH).json()
    assert [e["message"] for e in logs["entries"]] == ["starting"]
    assert logs["entries"][0]["fields"] == {"n": 30}
    task = httpx.get(f"{base}/tasks/img/1", headers=AUTH).json()
    assert task["progress"]["label"] == "chunk 30 of 30" and task["output_seq"] == 31
    assert httpx.get(f"{base}/tasks/img/1:output").status_code == 401
    assert httpx.get(f"{base}/tasks/img/1:stream").status_code == 401
    assert httpx.get(f"{base}/tasks/nope:output", headers=AUTH).status_code == 404
    assert httpx.get(f"{base}/tasks/nope:stream", headers=AUTH).status_code == 404
    for params in ({"kind": "logs"}, {"after": -1}, {"limit": 0}, {"limit": 1001}):
        bad = httpx.get(f"{base}/tasks/img/1:output", params=params, headers=AUTH)
        assert bad.status_code == 422, params
    bad = httpx.get(f"{base}/tasks/img/1:stream", headers={**AUTH, "Last-Event-ID": "x1"})
    assert bad.status_code == 422 and "Last-Event-ID" in bad.text
