"""A task's live output over HTTP (docs/output.md): the stored lines and chunks, and their
stream as Server-Sent Events, resumable with ``Last-Event-ID``.

``GET /tasks/{key}:output?after=&kind=&limit=`` returns ``{"entries": [...], "last": seq}``:
the entries after ``after``, oldest first, and the ``seq`` to pass as ``after`` for the next
page. ``GET /tasks/{key}:stream?after=&kind=`` streams them: one ``event: log`` or ``event:
chunk`` per entry, ``id:`` its ``seq`` and ``data:`` the entry as JSON, then new ones as the
task's runs write them, and ``event: end`` (``data: {"status": ...}``) once the task is
finished; a client that reconnects with ``Last-Event-ID`` (an ``EventSource`` does it by
itself) gets exactly the entries after it. ``: keep-alive`` comes every 15 s of silence.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Header, Query
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from mtask.client import AsyncTaskClient
from mtask.errors import InvalidTask, StorageError, TaskNotFound
from mtask.streams import Entry
from mtask.web.api import NOT_FOUND, Client
from mtask.web.auth import bearer_scheme, require_token

KEEPALIVE_SECONDS = 15.0
SEQ = re.compile(r"[0-9]{1,18}")
Kind = Literal["log", "chunk"]
router = APIRouter(dependencies=[Depends(require_token), Depends(bearer_scheme)])


class OutputView(BaseModel):
    entries: list[dict[str, Any]]
    last: int
    """The ``seq`` of the last entry returned (``after`` if none): the next page's ``after``."""


async def _known(client: AsyncTaskClient, key: str) -> None:
    if await client.get(key) is None:
        raise TaskNotFound(key)


@router.get("/tasks/{key:path}:output", responses=NOT_FOUND)
async def output(
    key: str,
    client: Client,
    after: Annotated[int, Query(ge=0, le=10**18, description="entries after this seq")] = 0,
    kind: Annotated[list[Kind] | None, Query(description="log, chunk (repeat)")] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 1000,
) -> OutputView:
    """The task's log lines and chunks after ``after``, oldest first."""
    await _known(client, key)
    entries = await client.output(key, after, kind, limit)
    return OutputView(
        entries=[e.to_json() for e in entries], last=entries[-1].seq if entries else after
    )


def frame(entry: Entry) -> str:
    return f"id: {entry.seq}\nevent: {entry.kind}\ndata: {json.dumps(entry.to_json())}\n\n"


async def _frames(
    client: AsyncTaskClient, key: str, after: int, kinds: list[str] | None, keepalive: float
) -> AsyncIterator[str]:
    yield "retry: 1000\n\n: open\n\n"
    entries = aiter(client.stream(key, after, kinds))
    pending: asyncio.Future[Entry] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(entries))
            done, _ = await asyncio.wait({pending}, timeout=keepalive)
            if not done:
                yield ": keep-alive\n\n"
                continue
            taken, pending = pending, None
            try:
                entry = taken.result()
            except StopAsyncIteration:
                break
            except (StorageError, TaskNotFound) as exc:
                yield f"event: error\ndata: {json.dumps({'detail': str(exc)})}\n\n"
                return
            yield frame(entry)
        task = await client.get(key)
        status = None if task is None or task.status is None else task.status.value
        yield f"event: end\ndata: {json.dumps({'status': status})}\n\n"
    finally:  # the client went away (or the stream ended): close the change stream
        if pending is not None:
            pending.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                await pending
        with contextlib.suppress(Exception):
            await entries.aclose()  # type: ignore[attr-defined]


@router.get(
    "/tasks/{key:path}:stream",
    response_class=StreamingResponse,
    responses={
        200: {"content": {"text/event-stream": {}}, "description": "lines and chunks"},
        **NOT_FOUND,
    },
)
async def stream(
    key: str,
    client: Client,
    after: Annotated[int, Query(ge=0, le=10**18, description="entries after this seq")] = 0,
    kind: Annotated[list[Kind] | None, Query(description="log, chunk (repeat)")] = None,
    last_event_id: Annotated[str | None, Header(description="resume after this seq")] = None,
) -> StreamingResponse:
    """The task's log lines and chunks as Server-Sent Events, until it is finished."""
    if last_event_id:
        if not SEQ.fullmatch(last_event_id):
            raise InvalidTask("not a seq this stream sent", field="Last-Event-ID")
        after = int(last_event_id)
    await _known(client, key)
    return StreamingResponse(
        _frames(client, key, after, [str(k) for k in kind] if kind else None, KEEPALIVE_SECONDS),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
    )
