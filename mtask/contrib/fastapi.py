"""mtask in a FastAPI application (docs/integrations.md, "FastAPI").

    tasks = Mtask("mongodb://…", database="shop")
    app = FastAPI(lifespan=tasks.lifespan)
    app.include_router(tasks.router(dependencies=[Depends(staff_only)]), prefix="/mtask")

    @app.post("/orders")
    async def place(client: Annotated[AsyncTaskClient, Depends(tasks.client)]) -> dict: ...

- ``lifespan``: opens one ``AsyncTaskClient`` (on pymongo's native async client) for the app,
  and, with ``Mtask(..., worker=registry)``, runs an in-process ``Worker`` beside it (drained
  on shutdown: its runs in flight finish within its ``grace``); closes both on shutdown.
- ``client``: the dependency that hands that client to a route.
- ``router(dependencies=[...])``: mtask's REST API, SSE and dashboard (``mtask serve``'s app)
  as a router, every request passing the application's own dependencies first (its auth);
  a request they let through reaches mtask as ``role`` (``admin`` by default), named by
  ``request.state.mtask_user`` if the dependency sets it (the audit's *who*). The router
  forwards to mtask's app in-process, mounted at the router's prefix (the dashboard's links
  follow it); mtask's own token and sign-in are not used.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.params import Depends
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from mtask.client import AsyncTaskClient
from mtask.web.auth import ROLES, Principal

if TYPE_CHECKING:
    from pymongo import AsyncMongoClient

    from mtask.registry import Registry
    from mtask.worker import Worker

METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]
DROPPED = ("route", "endpoint", "path_params", "router")
"""What the application's routing put in the request's scope: mtask's app routes it again."""


class Mtask:
    """mtask for one FastAPI application: its lifespan, its client dependency and its router
    (the module's docstring)."""

    def __init__(
        self,
        uri: str | None = None,
        *,
        database: str = "mtask",
        collection: str = "tasks",
        mongo_client: AsyncMongoClient[dict[str, Any]] | None = None,
        worker: Registry | None = None,
        worker_options: Mapping[str, Any] | None = None,
    ) -> None:
        self.uri, self.database, self.collection = uri, database, collection
        self.mongo_client = mongo_client
        self.registry = worker
        self.worker_options = dict(worker_options or {})
        self._client: AsyncTaskClient | None = None
        self._web: FastAPI | None = None
        self.worker: Worker | None = None
        """The in-process worker while the application runs (``worker=`` given)."""

    @contextlib.asynccontextmanager
    async def lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        """``FastAPI(lifespan=mtask.lifespan)``; to combine it with the application's own,
        ``async with mtask.lifespan(app):`` inside that one."""
        client = AsyncTaskClient(
            self.uri,
            database=self.database,
            collection=self.collection,
            mongo_client=self.mongo_client,
        )
        running: asyncio.Task[None] | None = None
        try:
            async with contextlib.AsyncExitStack() as stack:
                if self._web is not None:
                    await stack.enter_async_context(self._web.router.lifespan_context(self._web))
                if self.registry is not None:
                    running = self._start_worker()
                self._client = client
                try:
                    yield
                finally:
                    self._client = None
                    if running is not None and self.worker is not None:
                        await _stopped(self.worker, running)
        finally:
            self.worker = None
            await client.close()

    def _start_worker(self) -> asyncio.Task[None]:
        from mtask.worker import Worker

        assert self.registry is not None
        options = {"database": self.database, "collection": self.collection}
        self.worker = Worker(self.registry, uri=self.uri, **{**options, **self.worker_options})
        return asyncio.create_task(self.worker.run(), name="mtask-worker")

    def client(self) -> AsyncTaskClient:
        """The dependency: ``client: Annotated[AsyncTaskClient, Depends(mtask.client)]``."""
        if self._client is None:
            raise RuntimeError("mtask's client is open only while the application runs: "
                               "FastAPI(lifespan=mtask.lifespan)")  # fmt: skip
        return self._client

    def router(self, *, dependencies: Sequence[Depends] = (), role: str = "admin") -> APIRouter:
        """mtask's REST API, SSE and dashboard behind ``dependencies`` (include it with a
        ``prefix``); each caller they admit acts as ``role`` (viewer, operator or admin)."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}")
        if self._web is None:
            from mtask.web.app import create_app

            self._web = create_app(self.uri, database=self.database, collection=self.collection)
        web = self._web
        router = APIRouter(dependencies=list(dependencies))

        async def forward(request: Request, path: str) -> Response:
            who = str(getattr(request.state, "mtask_user", "app"))
            return Forwarded(web, Principal(role, who), path)

        router.add_api_route(
            "/{path:path}", forward, methods=METHODS, include_in_schema=False, name="mtask"
        )
        return router


async def _stopped(worker: Worker, running: asyncio.Task[None]) -> None:
    """The worker drained (its runs in flight finish within its ``grace``) and ended; one that
    had not begun yet is cancelled."""
    if worker.state == "ready":
        running.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await running
        return
    worker.stop()
    await running


class Forwarded(Response):
    """The request handed to mtask's app, mounted where the router's route matched it."""

    def __init__(self, app: Any, principal: Principal, path: str) -> None:
        super().__init__()
        self.app, self.principal, self.path = app, principal, path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        full: str = scope["path"]
        mount = full[: len(full) - len(self.path)] if self.path else full
        inner = {k: v for k, v in scope.items() if k not in DROPPED}
        inner["root_path"] = mount.rstrip("/")
        inner["mtask_principal"] = self.principal
        # the application authenticated the caller: its credentials are not mtask's
        inner["headers"] = [
            (k, v) for k, v in scope["headers"] if k.lower() not in (b"authorization",)
        ]
        await self.app(inner, receive, send)
