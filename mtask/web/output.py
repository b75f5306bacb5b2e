"""A task's live output over HTTP (docs/output.md): the stored lines and chunks, and their
stream as Server-Sent Events, resumable with ``Last-Event-ID``.

``GET /tasks/{key}:output?after=&kind=&limit=`` returns ``{"entries": [...], "last": seq}``:
the entries after ``after``, oldest first, and the ``seq`` to pass as ``after`` for the next
page. ``GET /tasks/{key}:stream?after=&kind=`` streams them: one ``event: log`` or ``event:
chunk`` per entry, ``id:`` its ``seq`` and ``data:`` the entry as JSON, then new ones as the
task's runs write them, and ``event: end`` (``data: {"status": ...}``) once the task is
finished; a client that reconnects with ``Last-Event-ID`` (an ``EventSource`` does it by
itself) gets exactly the entries after it. The SSE machinery (keep-alives, a client that goes
away) is ``mtask.web.events.relay``'s. Unknown query parameters are refused (422): a
misspelt ``kinds=log`` would otherwise read every kind.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Annotated, Any, Literal, cast

from fastapi import APIRouter, Depends, Header, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from mtask.client import AsyncTaskClient
from mtask.errors import TaskNotFound
from mtask.follow.streams import Entry
from mtask.web.access import authorize
from mtask.web.api import NOT_FOUND, Client
from mtask.web.auth import bearer_scheme
from mtask.web.events import Send, relay, sse_response

KEEPALIVE_SECONDS = 15.0
MAX_LIMIT = 1000
SEQ = re.compile(r"[0-9]{1,18}")
Kind = Literal["log", "chunk"]
router = APIRouter(dependencies=[Depends(authorize), Depends(bearer_scheme)])


def _only(*names: str) -> Any:
    """A dependency refusing query parameters other than ``names`` (422 naming them)."""

    async def check(request: Request) -> None:
        unknown = sorted(set(request.query_params) - set(names) - {"token"})  # a read token
        if unknown:
            hint = " (kind=log or kind=chunk; repeat it for both)" if "kinds" in unknown else ""
            raise RequestValidationError(
                [
                    {
                        "loc": ("query", name),
                        "msg": f"unknown query parameter; known: {', '.join(names)}{hint}",
                        "type": "unknown_parameter",
                    }
                    for name in unknown
                ]
            )

    return Depends(check)


class OutputView(BaseModel):
    entries: list[dict[str, Any]]
    last: int
    """The ``seq`` of the last entry returned (``after`` if none): the next page's ``after``."""


async def _known(client: AsyncTaskClient, key: str) -> None:
    if await client.get(key) is None:
        raise TaskNotFound(key)


@router.get(
    "/tasks/{key:path}:output",
    responses=NOT_FOUND,
    dependencies=[_only("after", "kind", "limit")],
)
async def output(
    key: str,
    client: Client,
    after: Annotated[int, Query(ge=0, le=10**18, description="entries after this seq")] = 0,
    kind: Annotated[list[Kind] | None, Query(description="log, chunk (repeat)")] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_LIMIT)] = MAX_LIMIT,
) -> OutputView:
    """The task's log lines and chunks after ``after``, oldest first."""
    await _known(client, key)
    entries = await client.output(key, after, kind, limit)
    return OutputView(
        entries=[e.to_json() for e in entries], last=entries[-1].seq if entries else after
    )


def frame(entry: Entry) -> str:
    return f"id: {entry.seq}\nevent: {entry.kind}\ndata: {json.dumps(entry.to_json())}\n\n"


def _frames(
    client: AsyncTaskClient, key: str, after: int, kinds: list[str] | None, keepalive: float
) -> AsyncIterator[str]:
    """``: open``, one frame per entry of ``client.stream``, then ``end`` with the status."""

    async def produce(send: Send) -> None:
        await send(": open\n\n")
        entries = cast(AsyncGenerator[Entry, None], client.stream(key, after, kinds))
        async with contextlib.aclosing(entries):  # closes its change stream on a cancel too
            async for entry in entries:
                await send(frame(entry))
        task = await client.get(key)
        status = None if task is None or task.status is None else task.status.value
        await send(f"event: end\ndata: {json.dumps({'status': status})}\n\n")

    return relay(produce, keepalive)


@router.get(
    "/tasks/{key:path}:stream",
    response_class=StreamingResponse,
    responses={
        200: {"content": {"text/event-stream": {}}, "description": "lines and chunks"},
        **NOT_FOUND,
    },
    dependencies=[_only("after", "kind")],
)
async def stream(
    key: str,
    client: Client,
    after: Annotated[int, Query(ge=0, le=10**18, description="entries after this seq")] = 0,
    kind: Annotated[list[Kind] | None, Query(description="log, chunk (repeat)")] = None,
    last_event_id: Annotated[str | None, Header(description="resume after this seq")] = None,
) -> StreamingResponse:
    """The task's log lines and chunks as Server-Sent Events, until it is finished. The
    ``Last-Event-ID`` header (an ``EventSource`` sends it when it reconnects) takes precedence
    over ``after``."""
    if last_event_id:
        if not SEQ.fullmatch(last_event_id):
            raise RequestValidationError(
                [
                    {
                        "loc": ("header", "Last-Event-ID"),
                        "msg": "Last-Event-ID is not a seq this stream sent (digits)",
                        "type": "value_error",
                    }
                ]
            )
        after = int(last_event_id)
    await _known(client, key)
    kinds = [str(k) for k in kind] if kind else None
    return sse_response(_frames(client, key, after, kinds, KEEPALIVE_SECONDS))
