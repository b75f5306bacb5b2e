"""The REST API: tasks, stats, workers, names, schedules, limits, health and metrics.

Every route but ``/healthz`` requires the bearer token (``mtask.web.auth``). Bad input is
refused with 422 naming the field, before anything is written: FastAPI checks the body's shape,
and mtask's own validation (``InvalidTask``) the rest. A missing task or schedule is 404, a
transition the task's state does not allow is 409, MongoDB out of reach 503.
"""

from __future__ import annotations

import asyncio
import datetime as dt
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field

from mtask.client import MAX_DELAY_SECONDS, AsyncTaskClient
from mtask.errors import TaskNotFound
from mtask.models import validate_name
from mtask.web.auth import require_token

MAX_BATCH = 10_000
Status = Literal["pending", "running", "succeeded", "failed", "cancelled", "invalid"]
"""The ``TaskStatus`` values, spelled out for the OpenAPI spec (a test keeps them in step)."""


class NewTaskBody(BaseModel):
    """A task to publish. ``options`` are ``TaskOptions`` (unknown ones are refused)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="the handler's name")
    key: str = Field(description="the task's key: publishing it again changes nothing")
    params: dict[str, Any] | None = None
    options: dict[str, Any] | None = None
    delay: float | None = Field(None, ge=0, le=MAX_DELAY_SECONDS, description="seconds")
    depends_on: list[str] | None = Field(None, max_length=1000)


class PublishBody(NewTaskBody):
    on_conflict: Literal["ignore", "update_params", "reset"] = "ignore"


class BatchBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tasks: list[NewTaskBody] = Field(max_length=MAX_BATCH)


class LimitBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    concurrency: int | None = Field(None, ge=1, le=1_000_000)
    rate: float | None = Field(None, gt=0, le=1_000_000, description="claims per second")
    burst: int | None = Field(None, ge=1, le=1_000_000)


Responses = dict[int | str, dict[str, Any]]
NOT_FOUND: Responses = {404: {"description": "no such task (or schedule, or worker)"}}
CONFLICT: Responses = {409: {"description": "the task's state does not allow this"}}


def client_of(request: Request) -> AsyncTaskClient:
    client: AsyncTaskClient = request.app.state.client
    return client


Client = Annotated[AsyncTaskClient, Depends(client_of)]
router = APIRouter(dependencies=[Depends(require_token)])
public = APIRouter()


def task_json(task: Any) -> dict[str, Any]:
    data: dict[str, Any] = task.model_dump(mode="json")
    return data


@router.post("/tasks", status_code=201, responses={200: {"description": "it existed"}})
async def publish(body: PublishBody, client: Client, response: Response) -> dict[str, Any]:
    """Publish a task: 201 when created, 200 when the key existed (idempotent)."""
    result = await client.publish(
        body.name,
        body.key,
        body.params,
        options=body.options,
        delay=body.delay,
        on_conflict=body.on_conflict,
        depends_on=body.depends_on,
    )
    if not result.created:
        response.status_code = 200
    return {"created": result.created, "updated": result.updated, "task": task_json(result.task)}


@router.post("/tasks:batch")
async def publish_batch(body: BatchBody, client: Client) -> dict[str, int]:
    """Publish many tasks (insert if absent); returns how many were created."""
    created = await client.publish_many(t.model_dump(exclude_none=True) for t in body.tasks)
    return {"created": created, "given": len(body.tasks)}


@router.get("/tasks")
async def list_tasks(
    client: Client,
    name: str | None = None,
    status: Status | None = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 50,
    after: str | None = Query(None, description="the last key of the previous page"),
) -> dict[str, Any]:
    tasks = await client.list(name=name, status=status, limit=limit, after=after)
    return {
        "tasks": [task_json(t) for t in tasks],
        "next_after": tasks[-1].key if len(tasks) == limit else None,
    }


@router.get("/tasks/{key:path}/flow", responses=NOT_FOUND)
async def flow(key: str, client: Client) -> dict[str, Any]:
    tree = await client.flow(key)
    if tree is None:
        raise TaskNotFound(key)
    return tree


@router.post("/tasks/{key:path}/cancel", responses={**NOT_FOUND, **CONFLICT})
async def cancel(key: str, client: Client) -> dict[str, Any]:
    return task_json(await client.cancel(key))


@router.post("/tasks/{key:path}/retry", responses={**NOT_FOUND, **CONFLICT})
async def retry(key: str, client: Client) -> dict[str, Any]:
    return task_json(await client.retry(key))


@router.get("/tasks/{key:path}", responses=NOT_FOUND)
async def get_task(key: str, client: Client) -> dict[str, Any]:
    task = await client.get(key)
    if task is None:
        raise TaskNotFound(key)
    return task_json(task)


@router.get("/stats")
async def stats(client: Client) -> dict[str, dict[str, int]]:
    """Task counts per name and status."""
    return await client.stats()


@router.get("/workers")
async def workers(client: Client) -> list[dict[str, Any]]:
    """Workers that sent a heartbeat in the last 10 seconds, with the runs they hold."""
    return await client.workers()


@router.post("/workers/{worker_id}/stop", responses=NOT_FOUND)
async def stop_worker(worker_id: str, client: Client) -> dict[str, str]:
    if not await client.stop_worker(worker_id):
        return JSONResponse(  # type: ignore[return-value]
            {"detail": f"no worker {worker_id!r} is registered"}, status_code=404
        )
    return {"stop_requested": worker_id}


@router.post("/names/{name}/pause")
async def pause(name: str, client: Client) -> dict[str, Any]:
    await client.pause(name)
    return {"name": name, "paused": True}


@router.post("/names/{name}/resume")
async def resume(name: str, client: Client) -> dict[str, Any]:
    await client.resume(name)
    return {"name": name, "paused": False}


@router.get("/names")
async def names(client: Client) -> dict[str, list[str]]:
    """Paused task names."""
    paused = await client.paused()
    return {"paused": sorted(paused)}


@router.get("/schedules")
async def schedules(client: Client) -> list[dict[str, Any]]:
    return await client.schedules()


@router.post("/schedules/{schedule_id}/pause", responses=NOT_FOUND)
async def pause_schedule(schedule_id: str, client: Client) -> dict[str, Any]:
    return await client.pause_schedule(schedule_id)


@router.post("/schedules/{schedule_id}/resume", responses=NOT_FOUND)
async def resume_schedule(schedule_id: str, client: Client) -> dict[str, Any]:
    return await client.resume_schedule(schedule_id)


@router.delete("/schedules/{schedule_id}", status_code=204, responses=NOT_FOUND)
async def remove_schedule(schedule_id: str, client: Client) -> Response:
    if not await client.remove_schedule(schedule_id):
        return JSONResponse({"detail": f"no schedule {schedule_id!r}"}, status_code=404)
    return Response(status_code=204)


@router.get("/limits")
async def limits(client: Client) -> list[dict[str, Any]]:
    return await client.limits()


@router.put("/limits/{name}")
async def set_limit(name: str, body: LimitBody, client: Client) -> dict[str, Any]:
    return await client.set_limit(
        name, concurrency=body.concurrency, rate=body.rate, burst=body.burst
    )


@router.delete("/limits/{name}", status_code=204)
async def clear_limit(name: str, client: Client) -> Response:
    validate_name(name)
    await client.clear_limit(name)
    return Response(status_code=204)


@router.get("/metrics", response_class=PlainTextResponse)
async def metrics() -> Response:
    """Prometheus text format (queue depth is one aggregation, cached a few seconds)."""
    body = await asyncio.to_thread(generate_latest)
    return Response(body, media_type=CONTENT_TYPE_LATEST)


@public.get("/healthz", responses={503: {"description": "MongoDB unreachable or not primary"}})
async def healthz(client: Client) -> JSONResponse:
    """MongoDB reachable and primary (no token needed)."""
    try:
        hello = await asyncio.wait_for(client.db.command("hello"), timeout=5)
    except Exception as exc:  # noqa: BLE001 - any failure is unhealthy, said in one line
        return JSONResponse({"ok": False, "error": f"{type(exc).__name__}: {exc}"[:300]}, 503)
    primary = bool(hello.get("isWritablePrimary"))
    now = hello.get("localTime")
    body = {
        "ok": primary,
        "primary": primary,
        "set": hello.get("setName"),
        "server_time": (now if now.tzinfo else now.replace(tzinfo=dt.UTC)).isoformat()
        if isinstance(now, dt.datetime)
        else None,
    }
    return JSONResponse(body, status_code=200 if primary else 503)
