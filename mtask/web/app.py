"""``create_app``: the FastAPI application of ``mtask serve`` — the REST API, the dashboard at
``/`` and ``/metrics``, on one ``AsyncTaskClient``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from fastapi.staticfiles import StaticFiles
from fastapi_offline import FastAPIOffline

import mtask
from mtask import metrics
from mtask.client import AsyncTaskClient, TaskClient
from mtask.errors import (
    InvalidTask,
    InvalidTransition,
    ScheduleNotFound,
    StorageError,
    TaskNotFound,
    TriggerNotFound,
)
from mtask.store import throughput
from mtask.web import api, dashboard, events, output, triggers
from mtask.web.access import RedactTokens
from mtask.web.audit import Audit
from mtask.web.auth import Keys, Principal
from mtask.web.guard import DEFAULT_MAX_BODY, Guard
from mtask.web.rates import Buckets, Failures, Rates

log = logging.getLogger("mtask.serve")
REDACT = RedactTokens()
SAMPLE_SECONDS = 5.0


async def _sample(client: AsyncTaskClient, every: float) -> None:
    """Side task: the last minutes' finished/failed counts per name into MongoDB (idempotent
    per minute, so any number of serves agree; a TTL index bounds it) for the charts: first
    the chart's whole hour, which holds what finished before serve started."""
    minutes = dashboard.CHART_MINUTES
    while True:
        try:
            await client.record_throughput(minutes)
            minutes = throughput.RECOUNT_MINUTES
        except StorageError as exc:
            log.warning("cannot record throughput: %s", exc)
        await asyncio.sleep(every)


def _clients(
    uri: str | None, database: str, collection: str, mongo_options: Mapping[str, Any] | None
) -> tuple[AsyncTaskClient, TaskClient]:
    """The app's clients: on ``uri``, or on pymongo clients made of ``mongo_options``."""
    if mongo_options is None:
        return (
            AsyncTaskClient(uri, database=database, collection=collection),
            TaskClient(uri, database=database, collection=collection),
        )
    from pymongo import AsyncMongoClient, MongoClient

    from mtask.connection.clients import CLIENT_OPTIONS, mend_pymongo

    options = {**CLIENT_OPTIONS, **mongo_options}
    mend_pymongo()  # as connection.clients.async_client does
    return (
        AsyncTaskClient(
            database=database, collection=collection, mongo_client=AsyncMongoClient(**options)
        ),
        TaskClient(database=database, collection=collection, mongo_client=MongoClient(**options)),
    )


def create_app(
    uri: str | None = None,
    *,
    database: str = "mtask",
    collection: str = "tasks",
    token: str | None = None,
    sample_seconds: float = SAMPLE_SECONDS,
    max_body: int = DEFAULT_MAX_BODY,
    trust_proxy: bool = False,
    tokens: Mapping[str, Principal] | None = None,
    read_secret: bytes | None = None,
    cors_origins: Sequence[str] = (),
    rate: tuple[float, int] | None = None,
    mongo_options: Mapping[str, Any] | None = None,
) -> FastAPI:
    """The app. ``max_body`` caps request bodies (bytes); ``trust_proxy`` believes a proxy's
    ``X-Forwarded-Proto`` / ``X-Forwarded-Host`` / ``X-Forwarded-For`` (for ``Secure``
    cookies, the origin check and the audit's address) — set it only when serve is reachable
    through that proxy alone. ``token`` is an admin's; ``tokens`` more, each a ``Principal``
    (role and name: docs/web.md, "Roles"). ``read_secret`` checks read tokens
    (``mtask.security.read_tokens``; None: refused); ``cors_origins`` may read with them from a
    browser; ``rate`` is (requests a second, burst) per caller (None: no limit).
    ``mongo_options``: pymongo's keyword arguments for the app's clients instead of ``uri`` (an
    embedding application's own connection settings, e.g. a Django database's)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        logging.getLogger("uvicorn.access").addFilter(REDACT)  # after uvicorn set its logging
        client, depth = _clients(uri, database, collection, mongo_options)
        try:
            await client.ensure_bulk_indexes()
        except StorageError as exc:  # serve starts anyway; /healthz says what is wrong
            log.warning("cannot create the task list's indexes: %s", exc)
        metrics.register_cluster_metrics(depth)
        app.state.client = client
        try:
            await client.ensure_audit()
        except StorageError as exc:  # the actions then fail to be recorded, each said
            log.warning("cannot make the audit collection: %s", exc)
        sampler = asyncio.create_task(_sample(client, sample_seconds))
        try:
            yield
        finally:
            sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampler
            await client.close()
            depth.close()
            if mongo_options is not None:  # the clients of given options are the app's own
                await client.mongo.close()
                depth.mongo.close()

    app = FastAPIOffline(
        title="mtask",
        version=mtask.__version__,
        description="Publish, read and steer mtask tasks. Every route but /healthz needs "
        "`Authorization: Bearer <token>` (Swagger UI: the Authorize button): a viewer's token "
        "reads, an operator's acts on tasks, an admin's also purges and sets limits (docs/web.md"
        "); a read token reads one task, its output and its stream. "
        "Actions on one task are `POST /tasks/{key}:cancel` and `:retry` (the key "
        "percent-encoded; the action is the last `:verb`).",
        lifespan=lifespan,
        static_url="/docs/assets",
        swagger_ui_parameters={"persistAuthorization": True},
    )
    app.state.token = token
    app.state.keys = Keys.of(token, tokens)
    app.state.read_secret = read_secret
    app.include_router(api.public)
    app.include_router(events.router)  # SSE and long-poll wait (before /tasks/{key})
    app.include_router(output.router)  # /tasks/{key}:output and :stream (before too)
    app.include_router(api.router)
    app.include_router(triggers.router)  # /triggers and /ui/triggers
    app.include_router(dashboard.router)
    app.include_router(triggers.pages)
    app.mount("/static", StaticFiles(directory=Path(__file__).parent / "static"), name="static")
    _errors(app)
    # the last added runs first: CORS (a preflight needs no token), the failed
    # authentications' rate (by address), the audit (which records the guard's refusals too),
    # the guard, the callers' rates
    buckets = Buckets(*rate) if rate is not None else None
    if buckets is not None:
        app.add_middleware(Rates, buckets=buckets)
    app.add_middleware(Guard, keys=app.state.keys, max_body=max_body, trust_proxy=trust_proxy)
    app.add_middleware(Audit, trust_proxy=trust_proxy)
    if buckets is not None:
        app.add_middleware(Failures, buckets=buckets, trust_proxy=trust_proxy)
    if cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(cors_origins),
            allow_methods=["GET"],
            allow_headers=["Authorization", "Last-Event-ID"],
            expose_headers=["Retry-After"],
        )
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
    @app.exception_handler(TriggerNotFound)
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
            {
                "loc": list(e.get("loc", ())),
                "msg": _extra(request, tuple(e.get("loc", ())))
                if e.get("type") == "extra_forbidden"
                else e.get("msg", ""),
                "type": e.get("type", ""),
            }
            for e in exc.errors()
        ]
        return JSONResponse({"detail": errors}, status_code=422)


def _extra(request: Request, loc: tuple[Any, ...]) -> str:
    """What an unknown field of a request's body is called: an unknown option under
    ``options``, else an unknown field, with the nearest known one (``parms``: did you mean
    ``params``?)."""
    import difflib

    if len(loc) > 2 and loc[-2] == "options":
        from mtask.vocabulary import OPTION_NAMES

        known: list[str] = list(OPTION_NAMES)
        what = "unknown option"  # the loc names it
    else:
        route = request.scope.get("route")
        info = getattr(getattr(route, "body_field", None), "field_info", None)
        model = getattr(info, "annotation", None)
        fields = getattr(model, "model_fields", {})
        known = [str(getattr(f, "alias", None) or n) for n, f in fields.items()]
        what = f"unknown field {str(loc[-1])!r}"
    close = difflib.get_close_matches(str(loc[-1]), known, n=1)
    return what + (f": did you mean {close[0]!r}?" if close else "")
