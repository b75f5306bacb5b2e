"""Waiting and events over HTTP, for services in any language.

``GET /events?name=…&status=…`` streams task events as Server-Sent Events: each ``id:`` is the
change stream's resume token, so a client that reconnects with ``Last-Event-ID`` (what an
``EventSource`` does by itself) continues exactly after the last event it saw. A comment line
``: open`` says the stream is open (every change after it is delivered) and ``: keep-alive``
comes every ``KEEPALIVE_SECONDS`` of silence. The stream ends when the client goes.

``relay`` is the SSE machinery itself (the ``retry:`` line, keep-alives, a bounded queue, and
closing the producer's change stream when the client goes): ``/events`` and a task's output
stream (``GET /tasks/{key}:stream``, ``mtask.web.output``) both use it.

The long poll is ``GET /tasks/{key}?wait=S`` (in ``mtask.web.api``): the task once it is
finished, or as it is after ``S`` seconds (its status says which).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Annotated

from fastapi import APIRouter, Depends, Header, Query
from fastapi.responses import StreamingResponse

from mtask.client import AsyncTaskClient
from mtask.errors import InvalidTask, MtaskError
from mtask.follow import events
from mtask.vocabulary import TaskStatus, validate_name
from mtask.web.access import authorize
from mtask.web.api import Client, Status

log = logging.getLogger("mtask.serve")
KEEPALIVE_SECONDS = 15.0
TOKEN = re.compile(r"[0-9A-Fa-f]{2,4096}")
router = APIRouter(dependencies=[Depends(authorize)])


def _check(names: list[str] | None, statuses: list[str] | None, token: str | None) -> None:
    for name in names or ():
        validate_name(name)
    known = {s.value for s in TaskStatus}
    for status in statuses or ():
        if status not in known:
            raise InvalidTask(f"unknown status {status!r}", field="status")
    if token is not None and not TOKEN.fullmatch(token):
        raise InvalidTask("not a token this stream sent", field="Last-Event-ID")


Send = Callable[[str], Awaitable[None]]
"""How a producer hands ``relay`` one SSE frame (it waits while the client is behind)."""
HEADERS = {"Cache-Control": "no-store", "X-Accel-Buffering": "no"}


def error_frame(detail: str) -> str:
    return f"event: error\ndata: {json.dumps({'detail': detail})}\n\n"


async def relay(produce: Callable[[Send], Awaitable[None]], keepalive: float) -> AsyncIterator[str]:
    """The body of an SSE response, shared by every stream serve has (``/events`` here, a
    task's output in ``mtask.web.output``): ``retry: 1000``, then the frames ``produce`` sends
    (through a bounded queue: a slow client slows the producer, never the server's memory),
    ``: keep-alive`` after ``keepalive`` seconds of silence, and the end when ``produce``
    returns. A producer's ``MtaskError`` (MongoDB out of reach) becomes ``event: error`` and
    the end. When the client goes away the server stops iterating this body, and the producer
    is cancelled: its change stream closes with it."""
    queue: asyncio.Queue[str | None] = asyncio.Queue(maxsize=1000)

    async def run() -> None:
        try:
            await produce(queue.put)
        except MtaskError as exc:
            await queue.put(error_frame(str(exc)))
        except Exception:
            log.exception("an SSE stream failed")
            await queue.put(error_frame("internal error (see the server's log)"))
        await queue.put(None)

    producer = asyncio.create_task(run(), name="mtask-sse")
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
        producer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await producer


def sse_response(body: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(body, media_type="text/event-stream", headers=HEADERS)


def frame(event: events.TaskEvent) -> str:
    data = json.dumps(event.to_json(), default=str)  # a hand-written odd value: still a frame
    return f"id: {event.token}\nevent: task\ndata: {data}\n\n"


def _frames(
    client: AsyncTaskClient,
    names: list[str] | None,
    statuses: list[str] | None,
    token: str | None,
    keepalive: float,
    *,
    progress: bool = False,
    steps: bool = False,
) -> AsyncIterator[str]:
    """``: open`` once the change stream is open (every change after it is delivered), or
    before the first event if that comes first; then one frame per event."""

    async def produce(send: Send) -> None:
        opened = asyncio.Event()
        announced = False

        async def announce() -> None:  # ": open" comes once, before any event
            nonlocal announced
            if not announced:
                announced = True
                await send(": open\n\n")

        async def on_open() -> None:
            await opened.wait()
            await announce()

        watcher = asyncio.create_task(on_open(), name="mtask-sse-open")
        try:
            stream = events.events(
                client.collection,
                names,
                statuses,
                token,
                opened=opened,
                progress=progress,
                steps=steps,
            )
            async for event in stream:
                await announce()
                await send(frame(event))
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher

    return relay(produce, keepalive)


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
    progress: Annotated[
        bool, Query(description="also the updates that report a run's progress")
    ] = False,
    steps: Annotated[
        bool, Query(description="also the durable steps recorded and the waits begun")
    ] = False,
) -> StreamingResponse:
    """Task events (insert and every status change) as Server-Sent Events; with
    ``progress=true`` and ``steps=true``, a run's progress and its durable steps too."""
    statuses: list[str] | None = [str(s) for s in status] if status else None
    _check(name, statuses, last_event_id)
    frames = _frames(
        client,
        name,
        statuses,
        last_event_id or None,
        KEEPALIVE_SECONDS,
        progress=progress,
        steps=steps,
    )
    return sse_response(frames)
