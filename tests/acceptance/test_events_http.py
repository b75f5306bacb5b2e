"""Waiting and events over HTTP: the SSE stream read by httpx and by Node.js's own
fetch, resumed with Last-Event-ID; the long-poll wait; auth and bad input."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2 as httpx
import pytest
from harness import node, running_worker, server_sent
from webserver import serving
from workerapp import registry

from mtask import TaskClient

TOKEN = "test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
SSE_MJS = Path(__file__).parent / "interop" / "sse.mjs"


@pytest.fixture
def base(mongo_uri: str, db_name: str) -> Iterator[str]:
    with serving(mongo_uri, db_name, token=TOKEN) as url:
        yield url


def read_events(
    base: str, count: int, headers: dict[str, str], ready: Any, params: dict[str, Any]
) -> list[dict[str, Any]]:
    """Read ``count`` task events with httpx's streaming API; call ``ready`` on ``: open``."""
    found: list[dict[str, Any]] = []
    with httpx.stream(
        "GET", f"{base}/events", params=params, headers={**AUTH, **headers}, timeout=60
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        for block in server_sent(response.iter_lines()):
            if block == ": open":
                ready()
            elif isinstance(block, dict) and block.get("event") == "task":
                found.append({"id": block["id"], **json.loads(block["data"])})
                if len(found) == count:
                    return found
    raise AssertionError(f"the stream ended after {found}")


async def reading(
    base: str, count: int, params: dict[str, Any]
) -> asyncio.Task[list[dict[str, Any]]]:
    """``read_events`` in a thread, once its stream is open (``: open``)."""
    opened = asyncio.Event()
    loop = asyncio.get_running_loop()
    reader = asyncio.create_task(
        asyncio.to_thread(
            read_events, base, count, {}, lambda: loop.call_soon_threadsafe(opened.set), params
        )
    )
    await opened.wait()
    return reader


async def test_sse_with_httpx_resumes_with_last_event_id(
    base: str, mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    assert httpx.get(f"{base}/events").status_code == 401
    bad = httpx.get(f"{base}/events", params={"status": "done"}, headers=AUTH)
    assert bad.status_code == 422
    bad = httpx.get(f"{base}/events", headers={**AUTH, "Last-Event-ID": "not a token"})
    assert bad.status_code == 422 and "Last-Event-ID" in bad.text
    params = {"name": "add", "status": "succeeded"}
    reader = await reading(base, 2, params)
    async with running_worker(registry, mongo_uri, db_name):
        for i in range(4):
            client.publish("add", f"h{i}", {"a": i, "b": 0})
            client.publish("echo", f"e{i}", {})
        first = await reader
        await asyncio.to_thread(client.wait, "h3", 30)
    assert all(e["name"] == "add" and e["status"] == "succeeded" for e in first)
    rest = await asyncio.to_thread(
        read_events, base, 2, {"Last-Event-ID": first[-1]["id"]}, lambda: None, params
    )
    assert sorted(e["key"] for e in first + rest) == ["h0", "h1", "h2", "h3"]  # none twice


async def test_sse_carries_durable_steps_when_asked(
    base: str, mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    reader = await reading(base, 5, {"name": "step_chain", "steps": "true"})
    async with running_worker(registry, mongo_uri, db_name):
        client.publish("step_chain", "sc1", {"count": 2, "uri": mongo_uri, "db": db_name})
        seen = await reader
    # one event a write: the publish, the claim, each step, the success; each event carries
    # the document as read when the event is sent, which on a busy machine may already be
    # the next write's (the success read for the last step's event)
    statuses = [e["status"] for e in seen]
    order = {"pending": 0, "running": 1, "succeeded": 2}
    assert statuses[0] == "pending" and statuses[-1] == "succeeded", statuses
    assert statuses == sorted(statuses, key=order.__getitem__), statuses
    steps = [s for e in seen for s in e.get("steps", [])]
    assert [(s["index"], s["name"], s["state"], s["attempts"]) for s in steps] == [
        (0, "s1", "done", 1),
        (1, "s2", "done", 1),
    ]
    assert all(s["started_at"] <= s["finished_at"] and "result" not in s for s in steps)
    refused = httpx.get(f"{base}/events", params={"steps": "maybe"}, headers=AUTH)
    assert refused.status_code == 422 and "steps" in refused.text


async def test_long_poll_wait(base: str, mongo_uri: str, db_name: str, client: TaskClient) -> None:
    assert httpx.get(f"{base}/tasks/nope?wait=1", headers=AUTH).status_code == 404
    assert httpx.get(f"{base}/tasks/nope?wait=1").status_code == 401
    client.publish("add", "img/1", {"a": 1, "b": 1})
    early = httpx.get(f"{base}/tasks/img/1", params={"wait": 0.2}, headers=AUTH)
    assert early.status_code == 200 and early.json()["status"] == "pending"
    assert httpx.get(f"{base}/tasks/img/1", params={"wait": -1}, headers=AUTH).status_code == 422
    async with running_worker(registry, mongo_uri, db_name):
        done = await asyncio.to_thread(
            httpx.get,
            f"{base}/tasks/img/1",
            params={"wait": 30},
            headers=AUTH,
            timeout=60,
        )
    assert done.status_code == 200 and done.json()["status"] == "succeeded"
    assert done.json()["result"] == 2


async def test_sse_from_node_fetch_with_last_event_id(
    base: str, mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    binary = node()

    async def start(count: int, *last: str) -> asyncio.subprocess.Process:
        proc = await asyncio.create_subprocess_exec(
            binary, str(SSE_MJS), base, TOKEN, "add", str(count), *last,
            stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        assert proc.stdout is not None
        assert (await asyncio.wait_for(proc.stdout.readline(), 30)).strip() == b"open"
        return proc

    async def lines(proc: asyncio.subprocess.Process) -> list[dict[str, Any]]:
        out, _ = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0, out
        return [json.loads(line) for line in out.decode().splitlines()]

    proc = await start(3)
    async with running_worker(registry, mongo_uri, db_name):
        client.publish("add", "n1", {"a": 1, "b": 1})  # pending, running, succeeded
        first = await lines(proc)
        assert [e["data"]["status"] for e in first] == ["pending", "running", "succeeded"]
        client.publish("add", "n2", {"a": 1, "b": 1})
        await asyncio.to_thread(client.wait, "n2", 30)
    proc = await start(3, first[-1]["id"])  # resumes: n2's events, none of n1's again
    second = await lines(proc)
    assert [(e["data"]["key"], e["data"]["status"]) for e in second] == [
        ("n2", "pending"),
        ("n2", "running"),
        ("n2", "succeeded"),
    ]
    assert len({e["id"] for e in first + second}) == 6
