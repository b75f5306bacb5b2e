"""Waiting and events over HTTP (issue 14), for services in any language.

``GET /events?name=…&status=…`` streams task events as Server-Sent Events: each ``id:`` is the
change stream's resume token, so a client that reconnects with ``Last-Event-ID`` (what an
``EventSource`` does by itself) continues exactly after the last event it saw. A comment line
``: open`` says the stream is open (every change after it is delivered) and ``: keep-alive``
comes every ``KEEPALIVE_SECONDS`` of silence. The stream ends when the client goes.

The long poll is ``GET /tasks/{key}?wait=S`` (in ``mtask.web.api``): the task once it is
finished, or as it is after ``S`` seconds (its status says which).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Depends, Header, Query
from fastapi.responses import StreamingResponse

from mtask import events
from mtask.client import AsyncTaskClient
from mtask.errors import InvalidTask, StorageError
from mtask.models import TaskStatus, validate_name
from mtask.web.api import Client, Status
from mtask.web.auth import require_token

KEEPALIVE_SECONDS = 15.0
TOKEN = re.compile(r"[0-9A-Fa-f]{2,4096}")
router = APIRouter(dependencies=[Depends(require_token)])


def _check(names: list[str] | None, statuses: list[str] | None, token: str | None) -> None:
    for name in names or ():
        validate_name(name)
    known = {s.value for s in TaskStatus}
    for status in statuses or ():
        if status not in known:
            raise InvalidTask(f"unknown status {status!r}", field="status")
    if token is not None and not TOKEN.fullmatch(token):
        raise InvalidTask("not a token this stream sent", field="Last-Event-ID")


def frame(event: events.TaskEvent) -> str:
    return f"id: {event.token}\nevent: task\ndata: {json.dumps(event.to_json())}\n\n"


async def _frames(
    client: AsyncTaskClient,
    names: list[str] | None,
    statuses: list[str] | None,
    token: str | None,
    keepalive: float,
) -> AsyncIterator[str]:
    queue: asyncio.Queue[str | None] = asyncio.Queue(maxsize=1000)
    opened = asyncio.Event()
    announced = False

    def announce() -> None:  # ": open" comes once, before any event
        nonlocal announced
        if not announced:
            announced = True
            queue.put_nowait(": open\n\n")

    async def produce() -> None:
        try:
            stream = events.events(client.collection, names, statuses, token, opened=opened)
            async for event in stream:
                announce()
                await queue.put(frame(event))
        except StorageError as exc:
            await queue.put(f"event: error\ndata: {json.dumps({'detail': str(exc)})}\n\n")
        await queue.put(None)

    async def on_open() -> None:
        await opened.wait()
        announce()

    producer = asyncio.create_task(produce(), name="mtask-sse")
    watcher = asyncio.create_task(on_open(), name="mtask-sse-open")
    try:
        yield "retry: 1000\n\n"
        while True:
            try:
                item = await asyncio.wait_for(queue.get(), keepalive)
            except TimeoutError:
                yield ": keep-alive\n\n"
                continue
            if item is None:
                return
            yield item
    finally:  # the client went away (or the stream ended): close the change stream
        for task in (producer, watcher):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


@router.get(
    "/events",
    response_class=StreamingResponse,
    responses={200: {"content": {"text/event-stream": {}}, "description": "task events"}},
)
async def stream_events(
    client: Client,
    name: Annotated[list[str] | None, Query(description="task names (repeat)")] = None,
    status: Annotated[list[Status] | None, Query(description="statuses (repeat)")] = None,
    last_event_id: Annotated[str | None, Header(description="resume after this event")] = None,
) -> StreamingResponse:
    """Task events (insert and every status change) as Server-Sent Events."""
    statuses: list[str] | None = [str(s) for s in status] if status else None
    _check(name, statuses, last_event_id)
    return StreamingResponse(
        _frames(client, name, statuses, last_event_id or None, KEEPALIVE_SECONDS),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
    )
