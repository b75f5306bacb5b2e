"""``create_app``: the FastAPI application of ``mtask serve`` — the REST API, the dashboard at
``/`` and ``/metrics``, on one ``AsyncTaskClient``."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import datetime as dt
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.staticfiles import StaticFiles

import mtask
from mtask import metrics
from mtask.client import AsyncTaskClient, TaskClient
from mtask.errors import InvalidTask, InvalidTransition, StorageError, TaskNotFound
from mtask.schedules import ScheduleNotFound
from mtask.web import api, dashboard

log = logging.getLogger("mtask.serve")
SAMPLE_SECONDS = 5.0
SAMPLES_KEPT = 180  # 15 minutes


@dataclass(frozen=True)
class Sample:
    at: dt.datetime
    finished: int
    """Succeeded + failed tasks, all names, at ``at``."""


async def _sample(
    client: AsyncTaskClient, samples: collections.deque[Sample], every: float
) -> None:
    """Side task: finished-task totals every few seconds, for the throughput chart."""
    while True:
        try:
            counts = await client.stats()
            finished = sum(s.get("succeeded", 0) + s.get("failed", 0) for s in counts.values())
            samples.append(Sample(await client.now(), finished))
        except StorageError as exc:
            log.warning("cannot sample throughput: %s", exc)
        await asyncio.sleep(every)


def create_app(
    uri: str | None = None,
    *,
    database: str = "mtask",
    collection: str = "tasks",
    token: str | None = None,
    sample_seconds: float = SAMPLE_SECONDS,
) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client = AsyncTaskClient(uri, database=database, collection=collection)
        depth = TaskClient(uri, database=database, collection=collection)
        metrics.register_queue_depth(depth.stats)
        app.state.client = client
        app.state.samples = collections.deque(maxlen=SAMPLES_KEPT)
        sampler = asyncio.create_task(_sample(client, app.state.samples, sample_seconds))
        try:
            yield
        finally:
            sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampler
            await client.close()
            depth.close()

    app = FastAPI(
        title="mtask",
        version=mtask.__version__,
        description="Publish, read and steer mtask tasks. Every route but /healthz needs "
        "`Authorization: Bearer <MTASK_API_TOKEN>`.",
        lifespan=lifespan,
    )
    app.state.token = token
    app.include_router(api.public)
    app.include_router(api.router)
    app.include_router(dashboard.router)
    app.mount("/static", StaticFiles(directory=Path(__file__).parent / "static"), name="static")
    _errors(app)
    return app


def _detail(field: str | None, message: str) -> list[dict[str, object]]:
    loc: list[str] = ["body", *(field.split(".") if field else [])]
    return [{"loc": loc, "msg": message, "type": "invalid_task"}]


def _errors(app: FastAPI) -> None:
    @app.exception_handler(InvalidTask)
    async def invalid(request: Request, exc: InvalidTask) -> JSONResponse:
        return JSONResponse({"detail": _detail(exc.field, exc.message)}, status_code=422)

    @app.exception_handler(TaskNotFound)
    @app.exception_handler(ScheduleNotFound)
    async def not_found(request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=404)

    @app.exception_handler(InvalidTransition)
    async def conflict(request: Request, exc: InvalidTransition) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=409)

    @app.exception_handler(StorageError)
    async def storage(request: Request, exc: StorageError) -> JSONResponse:
        if exc.document:  # MongoDB refused this very document: the input's fault
            return JSONResponse({"detail": _detail(None, str(exc))}, status_code=422)
        return JSONResponse({"detail": str(exc)}, status_code=503)

    @app.exception_handler(RequestValidationError)
    async def shape(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [
            {"loc": list(e.get("loc", ())), "msg": e.get("msg", ""), "type": e.get("type", "")}
            for e in exc.errors()
        ]
        return JSONResponse({"detail": errors}, status_code=422)
