"""The guard: a pure ASGI middleware that decides who is calling before any body is read.

For every HTTP request it, in order:

1. reads the credentials from the headers only: a strict bearer header (a malformed or wrong
   one is 401), else a signed session cookie (``mtask.web.auth``), else none;
2. refuses a body larger than the limit from its ``Content-Length`` (413 naming the limit);
3. refuses what needs credentials and has none (401) — API routes always, dashboard forms
   (``POST /ui/…``) too; dashboard pages render the sign-in form themselves;
4. refuses a cookie-authorised (or credential-less) state-changing request from another origin
   (403): ``Origin``, else ``Referer``, must be the server's own origin;
5. only then reads the body, counting bytes as they stream (413 past the limit), checks a JSON
   body's nesting depth (422 naming the limit), and for a session the CSRF token — the
   ``X-CSRF-Token`` header or the ``csrf`` form field (403) — and hands the body on.

An unauthenticated caller can make serve read at most ``LOGIN_MAX_BODY`` bytes (the sign-in
form), whatever it sends.
"""

from __future__ import annotations

import json
import re
import urllib.parse
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from mtask.web.auth import COOKIE, CSRF_FIELD, CSRF_HEADER, LOGIN_COOKIE, Keys, bearer_of

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

DEFAULT_MAX_BODY = 8 * 1024 * 1024
"""Fits a 1 MiB params document and a batch of small tasks."""
LOGIN_MAX_BODY = 16 * 1024
MAX_JSON_DEPTH = 80
"""Nesting levels of a JSON body (params are limited further, to ``models.MAX_PARAMS_DEPTH``)."""
SAFE = frozenset({"GET", "HEAD", "OPTIONS"})
PUBLIC = ("/healthz", "/static/", "/docs", "/redoc", "/openapi.json", "/favicon.ico", "/login")
_STRINGS = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)


class Refused(Exception):
    def __init__(self, status: int, detail: Any, headers: dict[str, str] | None = None) -> None:
        self.status, self.detail, self.headers = status, detail, headers or {}


def json_depth(body: bytes) -> int:
    """The deepest nesting of ``[`` / ``{`` in a JSON text (strings skipped)."""
    depth = deepest = 0
    for char in _STRINGS.sub(b"", body).translate(None, delete=b'\t\n\r ,:"0123456789.-+eE'):
        if char in b"[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in b"]}":
            depth -= 1
    return deepest


def cookies(headers: dict[str, str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for part in headers.get("cookie", "").split(";"):
        name, sep, value = part.strip().partition("=")
        if sep:
            out.setdefault(name, value)
    return out


class Guard:
    def __init__(
        self, app: App, *, keys: Keys, max_body: int = DEFAULT_MAX_BODY, trust_proxy: bool = False
    ) -> None:
        self.app, self.keys, self.max_body, self.trust_proxy = app, keys, max_body, trust_proxy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            receive = await self._check(scope, receive)
        except Refused as refused:
            await _answer(send, refused)
            return
        await self.app(scope, receive, send)

    def secure(self, scope: Scope, headers: dict[str, str]) -> bool:
        if scope.get("scheme") == "https":
            return True
        proto = headers.get("x-forwarded-proto", "").split(",")[0].strip().lower()
        return self.trust_proxy and proto == "https"

    def own_origin(self, scope: Scope, headers: dict[str, str]) -> str:
        host = headers.get("host", "")
        if self.trust_proxy and headers.get("x-forwarded-host"):
            host = headers["x-forwarded-host"].split(",")[0].strip()
        return f"{'https' if self.secure(scope, headers) else 'http'}://{host}"

    def same_origin(self, scope: Scope, headers: dict[str, str], required: bool) -> None:
        origin = headers.get("origin")
        if origin is None and headers.get("referer"):
            parts = urllib.parse.urlsplit(headers["referer"])
            origin = f"{parts.scheme}://{parts.netloc}"
        if origin is None:
            if required:
                raise Refused(403, "cross-site request refused: no Origin or Referer header")
            return
        if origin != self.own_origin(scope, headers):
            raise Refused(403, f"cross-site request refused: Origin {origin[:100]} is not ours")

    def _who(self, scope: Scope, headers: dict[str, str], jar: dict[str, str]) -> str | None:
        if "authorization" in headers:
            given = bearer_of(headers["authorization"])
            if not self.keys.token_ok(given) or given is None:
                raise Refused(401, "missing or wrong bearer token", {"WWW-Authenticate": "Bearer"})
            return "bearer"
        sid = self.keys.session_id(jar.get(COOKIE))
        if sid is not None:
            scope["mtask_sid"] = sid
            return "session"
        return "open" if self.keys.token is None else None

    async def _check(self, scope: Scope, receive: Receive) -> Receive:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        jar = cookies(headers)
        path: str = scope["path"]
        unsafe = scope["method"] not in SAFE
        who = self._who(scope, headers, jar)
        scope["mtask_auth"] = who
        scope["mtask_secure"] = self.secure(scope, headers)
        login = path == "/login" and unsafe
        limit = LOGIN_MAX_BODY if login else self.max_body
        readable = path.startswith(PUBLIC) or path == "/" or path.startswith("/ui/")
        if who is None and unsafe and path.startswith("/ui/"):  # a form after the session ended
            raise Refused(303, "sign in again", {"Location": "/login?problem=sign+in+again"})
        if who is None and not login and (unsafe or not readable):
            raise Refused(401, "missing or wrong bearer token", {"WWW-Authenticate": "Bearer"})
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            raise Refused(413, f"the request body is {length} bytes; the limit is {limit}")
        if not unsafe:
            return receive
        if who in ("session", None) or login:
            self.same_origin(scope, headers, required=True)
        elif who == "open":
            self.same_origin(scope, headers, required=False)
        body = await _read(receive, limit)
        self._body_checks(scope, headers, jar, body, who, login)
        return _replay(body, receive)

    def _body_checks(
        self,
        scope: Scope,
        headers: dict[str, str],
        jar: dict[str, str],
        body: bytes,
        who: str | None,
        login: bool,
    ) -> None:
        kind = headers.get("content-type", "").split(";")[0].strip().lower()
        if kind == "application/json" and json_depth(body) > MAX_JSON_DEPTH:
            raise Refused(
                422,
                [
                    {
                        "loc": ["body"],
                        "msg": f"JSON nested deeper than {MAX_JSON_DEPTH} levels",
                        "type": "too_deep",
                    }
                ],
            )
        if not login and who != "session":
            return
        given = headers.get(CSRF_HEADER)
        if given is None and kind == "application/x-www-form-urlencoded":
            form = urllib.parse.parse_qs(body.decode("utf-8", errors="replace"))
            given = next(iter(form.get(CSRF_FIELD) or ()), None)
        if login:
            nonce = jar.get(LOGIN_COOKIE)
            if not nonce or not self.keys.csrf_ok(nonce, given, purpose="login"):
                raise Refused(403, "sign-in refused: the form's CSRF token is missing or stale")
        elif not self.keys.csrf_ok(str(scope.get("mtask_sid")), given):
            raise Refused(403, "CSRF token missing or wrong (send X-CSRF-Token or csrf)")


async def _read(receive: Receive, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise Refused(400, "the client went away")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise Refused(413, f"the request body is over the limit of {limit} bytes")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replay(body: bytes, then: Receive) -> Receive:
    """The body read already, in one message; afterwards the connection's own messages (so a
    disconnect is still seen)."""
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if sent:
            return await then()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return receive


async def _answer(send: Send, refused: Refused) -> None:
    payload = json.dumps({"detail": refused.detail}).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(payload)).encode()),
        (b"connection", b"close"),
        *((k.lower().encode(), v.encode()) for k, v in refused.headers.items()),
    ]
    await send({"type": "http.response.start", "status": refused.status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
