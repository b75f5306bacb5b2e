"""A task's live output over HTTP (docs/output.md, docs/web.md): ``GET /tasks/{key}:output``
and the SSE stream ``GET /tasks/{key}:stream`` through the real app on a real MongoDB: resumed
with ``Last-Event-ID`` exactly once (and before ``after``), keep-alives, ``end`` once the task
is finished, the stream closed when its client goes; auth, bad input, a missing task; the
dashboard's task page shows the progress, each run's counts (truncated) and the newest lines."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import threading
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from typing import Any

import httpx2 as httpx
import pytest
from harness import running_worker, server_sent
from webserver import serving

from mtask import AsyncTaskClient, TaskClient
from mtask.follow.streams import Entry
from mtask.registry import Registry, TaskContext
from mtask.web import output

TOKEN = "test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
registry = Registry()
RELEASE: dict[str, asyncio.Event] = {}


@registry.task("chunks")
async def chunks(params: dict[str, int], ctx: TaskContext) -> int:
    """Chunk i is ``c<i>`` with seq i; ``lines`` log lines after them (the cap is 1,000)."""
    n = params["n"]
    for i in range(1, n + 1):
        ctx.emit(f"c{i}")
        ctx.progress(i / n, f"chunk {i} of {n}")
        if i % 10 == 0:
            await asyncio.sleep(0.002)
        if i == params.get("pause_at"):
            await RELEASE[ctx.key].wait()
    for j in range(1, params.get("lines", 1) + 1):
        ctx.log.info("done" if j == 1 else f"line {j}", n=n)
    return n


@pytest.fixture
def base(mongo_uri: str, db_name: str) -> Iterator[str]:
    with serving(mongo_uri, db_name, token=TOKEN) as url:
        yield url


def read_stream(
    base: str,
    key: str,
    stop_after: int | None,
    headers: dict[str, str],
    params: dict[str, Any],
    on_comment: Any = None,
) -> list[dict[str, Any]]:
    """The stream's frames (``event``, ``id``, ``data``) until ``end`` or ``stop_after`` chunks;
    ``on_comment(text)`` is called on each comment line (``: open``, ``: keep-alive``)."""
    frames: list[dict[str, Any]] = []
    with httpx.stream(
        "GET", f"{base}/tasks/{key}:stream", params=params, headers={**AUTH, **headers},
        timeout=60,
    ) as response:  # fmt: skip
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["cache-control"] == "no-store"
        for block in server_sent(response.iter_lines()):
            if isinstance(block, str):
                if on_comment is not None:
                    on_comment(block)
            elif "event" in block:
                frames.append({**block, "data": json.loads(block["data"])})
                if block["event"] in ("end", "error"):
                    return frames
                chunks = [f for f in frames if f["event"] == "chunk"]
                if stop_after is not None and len(chunks) == stop_after:
                    return frames  # the client goes away mid-stream
    raise AssertionError(f"the stream ended without 'end' after {len(frames)} frames")


async def test_sse_resumes_with_last_event_id_exactly_once(
    base: str, mongo_uri: str, db_name: str, aclient: AsyncTaskClient
) -> None:
    RELEASE["s"] = asyncio.Event()
    async with running_worker(registry, mongo_uri, db_name) as (_, events):
        # the handler waits at chunk 500 until the first reader has gone: the second one
        # reads stored chunks, then follows new ones as they are written
        await aclient.publish("chunks", "s", {"n": 1000, "pause_at": 500})
        first = await asyncio.to_thread(read_stream, base, "s", 300, {}, {"kind": "chunk"})
        assert [f["data"]["data"] for f in first] == [f"c{i}" for i in range(1, 301)]
        assert [f["id"] for f in first] == [str(i) for i in range(1, 301)]
        RELEASE["s"].set()
        # Last-Event-ID (what an EventSource sends when it reconnects) wins over ?after=
        again = {"Last-Event-ID": first[-1]["id"]}
        rest = await asyncio.to_thread(
            read_stream, base, "s", None, again, {"kind": "chunk", "after": 0}
        )
        await events.wait("recorded", key="s")
    assert first[-1]["id"] == "300"
    assert rest[-1] == {"event": "end", "data": {"status": "succeeded"}}
    data = [f["data"]["data"] for f in rest[:-1]]
    assert data == [f"c{i}" for i in range(301, 1001)]  # none lost, none twice
    assert [int(f["id"]) for f in rest[:-1]] == [f["data"]["seq"] for f in rest[:-1]]
    assert all(f["event"] == "chunk" for f in rest[:-1])
    both = await asyncio.to_thread(read_stream, base, "s", None, {}, {"after": 998})
    assert [(f["event"], f.get("id")) for f in both] == [
        ("chunk", "999"), ("chunk", "1000"), ("log", "1001"), ("end", None)
    ]  # fmt: skip
    assert both[2]["data"]["message"] == "done" and both[2]["data"]["fields"] == {"n": 1000}


def test_a_pending_tasks_stream_keeps_alive_and_ends_when_it_is_cancelled(
    base: str, client: TaskClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(output, "KEEPALIVE_SECONDS", 0.05)  # the server runs in this process
    client.publish("chunks", "idle", {"n": 1})  # no worker: nothing is said until it ends
    comments: list[str] = []

    def on_comment(line: str) -> None:
        comments.append(line)
        if line == ": keep-alive" and comments.count(line) == 1:
            client.cancel("idle")

    frames = read_stream(base, "idle", None, {}, {}, on_comment)
    assert frames == [{"event": "end", "data": {"status": "cancelled"}}]
    assert comments[0] == ": open" and ": keep-alive" in comments


def test_the_stream_closes_when_its_client_goes(
    base: str, client: TaskClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    closed = threading.Event()
    original = AsyncTaskClient.stream

    def watched(self: AsyncTaskClient, *args: Any, **kwargs: Any) -> AsyncIterator[Entry]:
        async def entries() -> AsyncGenerator[Entry, None]:
            inner = original(self, *args, **kwargs)
            try:
                async with contextlib.aclosing(inner):  # type: ignore[type-var]
                    async for entry in inner:
                        yield entry
            finally:
                closed.set()  # the stream's change stream is closed by now

        return entries()

    monkeypatch.setattr(AsyncTaskClient, "stream", watched)
    client.publish("chunks", "open", {"n": 1})  # no worker: the stream would follow for ever
    with httpx.stream("GET", f"{base}/tasks/open:stream", headers=AUTH, timeout=60) as response:
        lines = response.iter_lines()
        assert next(lines) == "retry: 1000" and next(lines) == ""
        assert next(lines) == ": open"
        assert not closed.is_set()
    assert closed.wait(30), "the server kept following after its client went"


def test_output_pages_auth_and_bad_input(base: str, client: TaskClient, drain: Any) -> None:
    asyncio.run(drain(registry, lambda: client.publish("chunks", "img/1", {"n": 30}), "img/1"))
    url = f"{base}/tasks/img/1:output"
    page = httpx.get(url, params={"after": 5, "limit": 10}, headers=AUTH)
    assert page.status_code == 200
    body = page.json()
    assert [e["seq"] for e in body["entries"]] == list(range(6, 16)) and body["last"] == 15
    assert body["entries"][0] == {
        "seq": 6, "kind": "chunk", "run_id": body["entries"][0]["run_id"], "attempt": 1,
        "at": body["entries"][0]["at"], "data": "c6",
    }  # fmt: skip
    everything = httpx.get(url, headers=AUTH).json()
    assert [e["seq"] for e in everything["entries"]] == list(range(1, 32))
    assert everything["last"] == 31
    logs = httpx.get(url, params={"kind": "log"}, headers=AUTH).json()
    assert [e["message"] for e in logs["entries"]] == ["done"] and logs["last"] == 31
    assert logs["entries"][0]["fields"] == {"n": 30} and logs["entries"][0]["level"] == "info"
    both = httpx.get(url, params=[("kind", "log"), ("kind", "chunk")], headers=AUTH).json()
    assert len(both["entries"]) == 31
    past = httpx.get(url, params={"after": 31}, headers=AUTH).json()
    assert past == {"entries": [], "last": 31}  # nothing after the last: the same after
    task = httpx.get(f"{base}/tasks/img/1", headers=AUTH).json()
    assert task["progress"]["label"] == "chunk 30 of 30" and task["progress"]["fraction"] == 1.0
    assert task["output_seq"] == 31
    assert task["runs"][0]["output"] == {
        "logs": 1, "chunks": 30, "logs_dropped": 0, "chunks_dropped": 0
    }  # fmt: skip

    for path in ("img/1:output", "img/1:stream"):  # the bearer token, as every API route
        assert httpx.get(f"{base}/tasks/{path}").status_code == 401
        wrong = {"Authorization": "Bearer nope"}
        assert httpx.get(f"{base}/tasks/{path}", headers=wrong).status_code == 401
    for path in ("nope:output", "nope:stream"):
        missing = httpx.get(f"{base}/tasks/{path}", headers=AUTH)
        assert missing.status_code == 404 and "nope" in missing.json()["detail"]
    for params, field in [
        ({"kind": "logs"}, "kind"),
        ({"after": -1}, "after"),
        ({"after": "x"}, "after"),
        ({"limit": 0}, "limit"),
        ({"limit": 1001}, "limit"),
        ({"kinds": "log"}, "kinds"),  # a misspelt parameter is refused, not ignored
    ]:
        bad = httpx.get(url, params=params, headers=AUTH)
        assert bad.status_code == 422, params
        assert bad.json()["detail"][0]["loc"][:2] == ["query", field], bad.json()
    assert "kind=log" in httpx.get(url, params={"kinds": "log"}, headers=AUTH).text
    for params in ({"kind": "logs"}, {"after": -1}, {"kinds": "chunk"}):
        bad = httpx.get(f"{base}/tasks/img/1:stream", params=params, headers=AUTH)
        assert bad.status_code == 422, params
    bad = httpx.get(f"{base}/tasks/img/1:stream", headers={**AUTH, "Last-Event-ID": "x1"})
    assert bad.status_code == 422 and "Last-Event-ID" in bad.text


async def test_the_task_page_shows_progress_counts_truncation_and_the_newest_lines(
    base: str, mongo_uri: str, db_name: str, aclient: AsyncTaskClient
) -> None:
    async with running_worker(registry, mongo_uri, db_name) as (_, events):
        await aclient.publish("chunks", "long", {"n": 40, "lines": 1005})  # past the cap
        await events.wait("recorded", key="long")
    await aclient.publish("chunks", "waiting", {"n": 1})

    def get(path: str) -> str:
        response = httpx.get(f"{base}{path}", headers=AUTH)  # the bearer signs the page in
        assert response.status_code == 200, response.text
        return response.text

    page = await asyncio.to_thread(get, "/ui/tasks/long")
    task = await aclient.get("long")
    assert task is not None and task.output_seq == 40 + 1001  # 1,000 lines and the marker
    assert 'aria-valuenow="100"' in page and "chunk 40 of 40" in page
    counts = page[page.index('id="output-counts"') :]
    counts = counts[: counts.index("</ul>")]
    assert "1001 lines, 40 chunks" in counts
    assert re.search(r'class="tag truncated">truncated: 5 lines dropped<', counts), counts
    shown = re.findall(r'<li class="entry (\w+)[^"]*"><span class="seq">(\d+)</span>', page)
    assert len(shown) == 200  # the newest 200, newest first
    assert [int(seq) for _, seq in shown] == list(range(1041, 841, -1))
    assert "The newest 200 of 1041 lines and chunks" in page
    assert '<li class="entry log truncated">' in page and "log truncated: the cap is" in page
    assert 'http-equiv="refresh"' not in page and "data-live" not in page  # finished

    waiting = await asyncio.to_thread(get, "/ui/tasks/waiting")  # open: live without JS too
    assert '<noscript><meta http-equiv="refresh"' in waiting and "data-live" in waiting
    assert 'id="output"' not in waiting  # nothing said yet
