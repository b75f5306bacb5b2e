"""mtask's dashboard, REST API and SSE in a Django project, behind Django's own login, for
staff users only: an ASGI application that serves a prefix of the project's URLs with mtask's
web app (``mtask serve``'s) and every other path with Django.

    # djproject/asgi.py
    import os

    from django.core.asgi import get_asgi_application

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "djproject.settings")
    from mtask.contrib.django.asgi import with_dashboard

    application = with_dashboard(get_asgi_application(), prefix="/mtask")

Each request under the prefix is checked against Django's session first (the session cookie,
``SESSION_ENGINE`` and ``django.contrib.auth``'s ``get_user``, on Django's sync thread): an
anonymous page request is redirected to ``LOGIN_URL?next=…``, an anonymous API request
answered 401; a signed-in user that ``allow`` refuses (by default one who is not staff) gets
403. A user it admits reaches mtask as ``role`` (admin by default), named by their username in
mtask's audit; mtask's own tokens are not used. A request that changes something must come
from the page's own origin (its ``Origin`` or ``Referer``, which mtask's guard compares with the
host), as Django's CSRF protection asks of a form. mtask connects as the task backend
``backend`` of ``TASKS`` does (its ``database_alias``'s settings, or its ``uri``), and starts
with the server's ASGI lifespan (or, on a server without one, at the first request under the
prefix). It needs the server extra (``pip install "mtask[django,server]"``). It is an ASGI
entry: the project runs under an ASGI server (uvicorn, daphne, hypercorn); ``runserver`` is
WSGI and serves only Django's own URLs.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from importlib import import_module
from typing import Any

try:
    from starlette.types import ASGIApp, Receive, Scope, Send

    from mtask.web.auth import ROLES, Principal
    from mtask.web.guard import Refused, _answer, cookies, header_map
except ImportError as missing:  # the dashboard is mtask serve's: the server extra
    raise ImportError(
        f'mtask.contrib.django.asgi needs mtask\'s web app: pip install "mtask[django,server]" '
        f"({missing})"
    ) from missing

from mtask.contrib.django.compat import DEFAULT_TASK_BACKEND_ALIAS

SAFE = frozenset({"GET", "HEAD", "OPTIONS"})


def is_staff(user: Any) -> bool:
    """The default ``allow``: Django's staff (an inactive user never gets this far)."""
    return bool(user.is_staff)


@dataclass(frozen=True)
class Caller:
    """Who Django's session says is calling: ``name`` None when nobody is signed in."""

    name: str | None
    allowed: bool
    login: str
    """Where the sign-in page is, with ``next`` back to the request."""


def caller(session_key: str | None, next_url: str, allow: Callable[[Any], bool]) -> Caller:
    """The session's user, as Django's ``AuthenticationMiddleware`` would find it (sync: it
    reads the session store and the user from the database)."""
    from django.conf import settings
    from django.contrib.auth import get_user
    from django.contrib.auth.views import redirect_to_login
    from django.db import close_old_connections
    from django.http import HttpRequest

    close_old_connections()  # as Django around each request (CONN_MAX_AGE)
    try:
        request = HttpRequest()
        request.session = import_module(settings.SESSION_ENGINE).SessionStore(session_key)
        user = get_user(request)
        login = redirect_to_login(next_url)["Location"]
        if not user.is_authenticated:
            return Caller(None, False, login)
        return Caller(user.get_username(), bool(allow(user)), login)
    finally:
        close_old_connections()


class Dashboard:
    """The ASGI application: ``prefix`` to mtask's web app for the users ``allow`` admits,
    the rest to ``django`` (the module's docstring)."""

    def __init__(
        self,
        django: ASGIApp,
        *,
        prefix: str = "/mtask",
        backend: str = DEFAULT_TASK_BACKEND_ALIAS,
        role: str = "admin",
        allow: Callable[[Any], bool] = is_staff,
    ) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}")
        self.django, self.backend, self.role, self.allow = django, backend, role, allow
        self.prefix = "/" + prefix.strip("/")
        if self.prefix == "/":
            raise ValueError("prefix must name a path under the project's root, e.g. /mtask")
        self._web: Any = None
        self._running: contextlib.AsyncExitStack | None = None
        self._starting = asyncio.Lock()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        within = self._within(scope) if scope["type"] == "http" else None
        if within is None:
            await self.django(scope, receive, send)
            return
        try:
            principal = await self._admitted(scope, within)
        except Refused as refused:
            await _answer(send, refused)
            return
        await self._start()
        root = str(scope.get("root_path", "")).rstrip("/")
        inner = {**scope, "root_path": root + self.prefix, "mtask_principal": principal}
        # Django authenticated the caller: a bearer token is not mtask's to check
        inner["headers"] = [(k, v) for k, v in scope["headers"] if k.lower() != b"authorization"]
        await self._web(inner, receive, send)

    def _within(self, scope: Scope) -> str | None:
        """The request's path under the prefix (``""`` for the prefix itself), or None."""
        path: str = scope["path"]
        root = str(scope.get("root_path", "")).rstrip("/")
        if root and path.startswith(root + "/"):
            path = path[len(root) :]
        if path == self.prefix or path.startswith(self.prefix + "/"):
            return path[len(self.prefix) :]
        return None

    async def _admitted(self, scope: Scope, within: str) -> Principal:
        """The caller as mtask's principal, or ``Refused`` saying why not."""
        from asgiref.sync import sync_to_async
        from django.conf import settings

        headers = header_map(scope["headers"])
        query = scope.get("query_string", b"").decode("latin-1")
        here = scope["path"] + (f"?{query}" if query else "")
        if within == "":  # the prefix itself: the dashboard is at the prefix and a slash
            slashed = scope["path"] + "/" + (f"?{query}" if query else "")
            raise Refused(308, "the dashboard is under a slash", {"Location": slashed})
        key = cookies(headers).get(settings.SESSION_COOKIE_NAME)
        found = await sync_to_async(caller)(key, here, self.allow)
        page = within == "/" or within.startswith("/ui/")
        if found.name is None and page:
            status = 302 if scope["method"] in SAFE else 303
            raise Refused(status, "sign in first", {"Location": found.login})
        if found.name is None:
            raise Refused(401, "sign in to the site first")
        if not found.allowed:
            raise Refused(403, f"{found.name} may not use mtask's dashboard")
        if scope["method"] not in SAFE and not ("origin" in headers or "referer" in headers):
            raise Refused(403, "cross-site request refused: no Origin or Referer header")
        return Principal(self.role, found.name)

    # -- mtask's web app and its lifespan -------------------------------------------------------

    def web(self) -> Any:
        """mtask's web app, connected as the task backend ``backend`` is."""
        if self._web is None:
            from mtask.contrib.django.backend import MtaskBackend
            from mtask.contrib.django.compat import task_backends
            from mtask.web.app import create_app

            backend = task_backends[self.backend]
            if not isinstance(backend, MtaskBackend):
                raise TypeError(f"TASKS[{self.backend!r}] is not an mtask.contrib.django backend")
            options = None
            if backend.database_alias is not None:
                options = backend.connection().get_connection_params()
            self._web = create_app(
                backend.uri,
                database=backend.database,
                collection=backend.collection,
                mongo_options=options,
            )
        return self._web

    async def _start(self) -> None:
        """mtask's web app's lifespan entered once (a server without a lifespan: here)."""
        async with self._starting:
            if self._running is not None:
                return
            from asgiref.sync import sync_to_async

            web = await sync_to_async(self.web)()
            stack = contextlib.AsyncExitStack()
            await stack.enter_async_context(web.router.lifespan_context(web))
            self._running = stack

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        """The server's lifespan: mtask's web app started and stopped with it (Django's own
        ASGI handler has none)."""
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self._start()
                except Exception as exc:  # noqa: BLE001 - the server says it and stops
                    await send({"type": "lifespan.startup.failed", "message": repr(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                running, self._running = self._running, None
                if running is not None:
                    await running.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return


def with_dashboard(
    django: ASGIApp,
    *,
    prefix: str = "/mtask",
    backend: str = DEFAULT_TASK_BACKEND_ALIAS,
    role: str = "admin",
    allow: Callable[[Any], bool] = is_staff,
) -> Dashboard:
    """``django`` (``get_asgi_application()``) with mtask's dashboard and REST API under
    ``prefix`` for the users ``allow`` admits (staff by default), each acting as ``role``."""
    return Dashboard(django, prefix=prefix, backend=backend, role=role, allow=allow)
