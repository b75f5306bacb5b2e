"""The guard: a pure ASGI middleware that decides who is calling before any body is read.

For every HTTP request it, in order:

0. reads the headers once, as Starlette does (the first of repeated ones), and refuses a request
   repeating one the guard decides on (``SINGLE``: ``Content-Type``, ``Authorization``,
   ``Origin``, …; 400): the guard and the app must not read two different values;
1. reads the credentials from the headers only: a strict bearer header (a malformed or wrong
   one is 401), else a signed session cookie (``mtask.web.auth``), else none;
2. refuses a body larger than the limit from its ``Content-Length`` (413 naming the limit);
3. refuses what needs credentials and has none (401) — API routes always, dashboard forms
   (``POST /ui/…``) too; dashboard pages render the sign-in form themselves;
4. refuses a cookie-authorised (or credential-less) state-changing request from another origin
   (403): ``Origin``, else ``Referer``, must be the server's own origin (a ``Referer`` that is not
   a URL is refused too);
5. only then reads the body, counting bytes as they stream (413 past the limit) and scanning a
   JSON body's nesting depth as it streams (422 naming the limit),
   checks for a session the CSRF token — the ``X-CSRF-Token`` header or the ``csrf`` form field
   (403) — and hands the body on.

An unauthenticated caller can make serve read at most ``LOGIN_MAX_BODY`` bytes (the sign-in
form), whatever it sends.

**Cost.** Every check is linear in what it looks at, with a small constant, for any caller:
the headers are split and compared once; the depth scan (``DepthScan``) runs per piece of at
most ``PIECE`` bytes as the body streams, a fixed number of whole-piece C passes
(``bytes.replace``/``translate``/``split``/``count``, ``int(…, 2)``) and one C-level
``accumulate`` over one value per 8 brackets — no regex and no backtracking; the form's CSRF
field is found with ``bytes.find``. Measured (docs/web.md, "Web surface"): at most ~25 ns a
byte on crafted bodies, so one 64 KiB piece holds the event loop about 2 ms and the 16 KiB
sign-in form under 1 ms, and the scan yields to the loop between pieces.
"""

from __future__ import annotations

import asyncio
import json
import urllib.parse
from collections.abc import Awaitable, Callable, MutableMapping
from itertools import accumulate
from operator import add
from typing import Any

from mtask.security.read_tokens import is_read_token
from mtask.web.auth import (
    COOKIE,
    CSRF_FIELD,
    CSRF_HEADER,
    LOGIN_COOKIE,
    LOOPBACK,
    Keys,
    bearer_of,
    failed,
)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

DEFAULT_MAX_BODY = 8 * 1024 * 1024
"""Fits a 1 MiB params document and a batch of small tasks."""
LOGIN_MAX_BODY = 16 * 1024
MAX_JSON_DEPTH = 80
"""Nesting levels of a JSON body (params are limited further: ``vocabulary.MAX_PARAMS_DEPTH``)."""
SAFE = frozenset({"GET", "HEAD", "OPTIONS"})
PUBLIC = ("/healthz", "/static/", "/docs", "/redoc", "/openapi.json", "/favicon.ico", "/login")
PIECE = 64 * 1024
"""The depth scan's unit of work: the loop runs other requests between pieces."""
SINGLE = frozenset(
    {"host", "content-length", "content-type", "authorization", "origin", "referer", CSRF_HEADER}
)
"""Headers a request may send once: the guard decides on them, and a repeated one would leave
the guard and the app (which reads the first) to disagree on what the request is."""


class Refused(Exception):
    def __init__(self, status: int, detail: Any, headers: dict[str, str] | None = None) -> None:
        self.status, self.detail, self.headers = status, detail, headers or {}


_STRUCTURE = b'"[]{}'
_NOT_STRUCTURE = bytes(c for c in range(256) if c not in _STRUCTURE)
_BITS = bytes.maketrans(b"[{]}", b"1100")


def _group(bits: int) -> tuple[int, int]:
    """Net depth change and highest depth (from 0, at least 0) of 8 brackets, MSB first."""
    depth = peak = 0
    for shift in range(7, -1, -1):
        depth += 1 if bits >> shift & 1 else -1
        peak = max(peak, depth)
    return depth, peak


_NET = bytes(_group(v)[0] & 0xFF for v in range(256))
_PEAK = bytes(_group(v)[1] for v in range(256))


class DepthScan:
    """The deepest nesting of ``[`` / ``{`` outside strings in a JSON text fed in pieces, in one
    pass, never looking at a byte twice (but for one carried backslash).

    Per piece: escape pairs go (``\\\\`` first, then ``\\"``, so the quotes left delimit strings
    — a backslash run split between pieces carries its odd last backslash over); every byte but
    ``"[]{}`` goes; splitting on ``"`` and keeping every other part (which parity carries over)
    leaves the brackets outside strings; those become bits, packed 8 to a byte, and a table
    gives each byte its net change and its peak, so the running depth is one ``accumulate``
    over an eighth as many values. All of it is C over the piece.

    On a valid JSON text ``deepest`` is exactly its nesting. On an invalid one it is at least
    the depth a parser reaches before the first error (up to that point the scan and a parser
    agree), which is what the limit is for. ``done`` is set when nothing later can matter:
    deeper than ``stop_above``, or more closed than opened (a parser has stopped there).
    """

    def __init__(self, stop_above: int | None = None) -> None:
        self.stop_above = stop_above
        self.deepest = 0
        self.done = False
        self._depth = 0
        self._in_string = False
        self._carry = b""

    def feed(self, piece: bytes) -> None:
        if self.done or not piece:
            return
        data = self._carry + piece
        run = len(data) - len(data.rstrip(b"\\"))
        if run % 2:  # its last backslash escapes the next piece's first byte
            data, self._carry = data[:-1], b"\\"
        else:
            self._carry = b""
        kept = data.replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, _NOT_STRUCTURE)
        parts = kept.split(b'"')
        self._count(b"".join(parts[1::2] if self._in_string else parts[0::2]))
        self._in_string ^= len(parts) % 2 == 0

    def _count(self, brackets: bytes) -> None:
        size = len(brackets)
        if not size:
            return
        bits = brackets.translate(_BITS)
        pad = -size % 8  # closing brackets after the end raise no peak
        packed = int(bits + b"0" * pad, 2).to_bytes((size + pad) // 8, "big")
        starts = accumulate(memoryview(packed.translate(_NET)).cast("b"), initial=self._depth)
        self.deepest = max(self.deepest, max(map(add, starts, packed.translate(_PEAK))))
        self._depth += 2 * bits.count(b"1") - size
        too_deep = self.stop_above is not None and self.deepest > self.stop_above
        self.done = too_deep or self._depth < 0


def json_depth(body: bytes, stop_above: int | None = None) -> int:
    """The deepest nesting of ``[`` / ``{`` in a JSON text (strings skipped); with
    ``stop_above``, the scan may stop at the first depth beyond it."""
    scan = DepthScan(stop_above)
    for start in range(0, len(body), PIECE):
        scan.feed(body[start : start + PIECE])
        if scan.done:
            break
    return scan.deepest


def form_field(body: bytes, name: str, longest: int = 256) -> str | None:
    """The first non-empty value of field ``name`` in an urlencoded form, found with
    ``bytes.find`` (linear): the name must be spelled as is (browsers do), and a value longer
    than ``longest`` bytes reads as ``""`` (no token is that long) rather than being decoded."""
    key = b"&" + name.encode() + b"="
    data = b"&" + body
    at = data.find(key)
    while at != -1:
        start = at + len(key)
        end = data.find(b"&", start)
        value = data[start : len(data) if end == -1 else end]
        if value:
            if len(value) > longest:
                return ""
            return urllib.parse.unquote_plus(value.decode("utf-8", errors="replace"))
        at = -1 if end == -1 else data.find(key, end)
    return None


def is_json(kind: str) -> bool:
    """Whether FastAPI parses a body of this (lower-cased) media type as JSON: no type,
    ``application/json`` or ``application/…+json``."""
    return (
        not kind
        or kind == "application/json"
        or (kind.startswith("application/") and kind.endswith("+json"))
    )


def too_deep() -> Refused:
    detail = f"JSON nested deeper than {MAX_JSON_DEPTH} levels"
    return Refused(422, [{"loc": ["body"], "msg": detail, "type": "too_deep"}])


def header_map(raw: list[tuple[bytes, bytes]]) -> dict[str, str]:
    """The request's headers by lower-case name, the first value of a repeated one (as
    Starlette reads them); one of ``SINGLE`` repeated is refused (400)."""
    headers: dict[str, str] = {}
    for key, value in raw:
        name = key.decode("latin-1").lower()
        if name not in headers:
            headers[name] = value.decode("latin-1")
        elif name in SINGLE:
            raise Refused(400, f"the {name} header is repeated: send it once")
    return headers


def read_token_of(scope: Scope) -> str | None:
    """A read token in a ``GET``'s query (``?token=…``: an ``EventSource`` cannot send a
    header), else None."""
    if scope["method"] != "GET" or b"token=" not in scope.get("query_string", b""):
        return None
    query = urllib.parse.parse_qs(scope["query_string"].decode("latin-1"))
    found = (query.get("token") or [""])[0]
    return found if is_read_token(found) else None


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
            try:
                parts = urllib.parse.urlsplit(headers["referer"])
            except ValueError:  # "http://[::1": a bracket not closed, or a bad host
                raise Refused(403, "cross-site request refused: the Referer is not a URL") from None
            origin = f"{parts.scheme}://{parts.netloc}"
        if origin is None:
            if required:
                raise Refused(403, "cross-site request refused: no Origin or Referer header")
            return
        if origin != self.own_origin(scope, headers):
            raise Refused(403, f"cross-site request refused: Origin {origin[:100]} is not ours")

    def _who(self, scope: Scope, headers: dict[str, str], jar: dict[str, str]) -> str | None:
        """``bearer``, ``session``, ``read`` (a read token: ``mtask.security.read_tokens``),
        ``open`` (no token configured) or None; the caller's ``Principal`` in
        ``mtask_principal``."""
        if "authorization" in headers:
            given = bearer_of(headers["authorization"])
            if given is not None and is_read_token(given):
                scope["mtask_read_token"] = given
                return "read"
            principal = None if given is None else self.keys.principal(given)
            if principal is None:
                failed(scope, "bearer token")
                raise Refused(401, "missing or wrong bearer token", {"WWW-Authenticate": "Bearer"})
            scope["mtask_principal"] = principal
            return "bearer"
        session = self.keys.session(jar.get(COOKIE))
        if session is not None:
            scope["mtask_sid"], scope["mtask_principal"] = session
            return "session"
        if jar.get(COOKIE):  # forged, expired, or signed before a token changed
            failed(scope, "session")
        query = read_token_of(scope)
        if query is not None:
            scope["mtask_read_token"] = query
            return "read"
        if self.keys.open:  # an app that embeds this one (mtask.contrib) may name its caller
            scope.setdefault("mtask_principal", LOOPBACK)
            return "open"
        return None

    async def _check(self, scope: Scope, receive: Receive) -> Receive:
        headers = header_map(scope["headers"])
        jar = cookies(headers)
        path = route_path(scope)
        unsafe = scope["method"] not in SAFE
        who = self._who(scope, headers, jar)
        scope["mtask_auth"] = who
        scope["mtask_secure"] = self.secure(scope, headers)
        login = path == "/login" and unsafe
        limit = LOGIN_MAX_BODY if login else self.max_body
        _admit(path, who, unsafe, login, str(scope.get("root_path", "")).rstrip("/"))
        _within(headers.get("content-length", ""), limit)
        if not unsafe:
            return receive
        if who in ("session", None) or login:
            self.same_origin(scope, headers, required=True)
        elif who == "open":
            self.same_origin(scope, headers, required=False)
        kind = headers.get("content-type", "").split(";")[0].strip().lower()
        scan = DepthScan(stop_above=MAX_JSON_DEPTH) if is_json(kind) else None
        body = await _read(receive, limit, scan)
        if scan is not None and scan.deepest > MAX_JSON_DEPTH:
            raise too_deep()
        self._body_checks(scope, headers, jar, body, kind, who, login)
        return _replay(body, receive)

    def _body_checks(
        self,
        scope: Scope,
        headers: dict[str, str],
        jar: dict[str, str],
        body: bytes,
        kind: str,
        who: str | None,
        login: bool,
    ) -> None:
        if not login and who != "session":
            return
        given = headers.get(CSRF_HEADER)
        if given is None and kind == "application/x-www-form-urlencoded":
            given = form_field(body, CSRF_FIELD)
        if login:
            nonce = jar.get(LOGIN_COOKIE)
            if not nonce or not self.keys.csrf_ok(nonce, given, purpose="login"):
                raise Refused(403, "sign-in refused: the form's CSRF token is missing or stale")
        elif not self.keys.csrf_ok(str(scope.get("mtask_sid")), given):
            raise Refused(403, "CSRF token missing or wrong (send X-CSRF-Token or csrf)")


def client_address(scope: Scope, trust_proxy: bool) -> str:
    """Who sends the request: the connection's address, or with ``trust_proxy`` the first
    address of ``X-Forwarded-For`` (the audit's ``from``, the rates' address)."""
    if trust_proxy:
        for key, value in scope["headers"]:
            if key.lower() == b"x-forwarded-for":
                forwarded = str(value.decode("latin-1")).split(",")[0].strip()
                if forwarded:
                    return forwarded
                break
    client = scope.get("client")
    return str(client[0]) if client else "unknown"


def route_path(scope: Scope) -> str:
    """The request's path within the app: ``path`` less the ``root_path`` the app is mounted
    at (a Starlette ``Mount`` keeps both, as ASGI says), as its routes match it."""
    path: str = scope["path"]
    root = str(scope.get("root_path", "")).rstrip("/")
    if root and (path == root or path.startswith(root + "/")):
        return path[len(root) :] or "/"
    return path


def _admit(path: str, who: str | None, unsafe: bool, login: bool, root: str = "") -> None:
    """Refuse a request that ``who`` (``Guard._who``: ``None``, no credentials) may not make
    to ``path``, before its body is read (``root``: where the app is mounted)."""
    readable = path.startswith(PUBLIC) or path == "/" or path.startswith("/ui/")
    if who is None and unsafe and path.startswith("/ui/"):  # a form after the session ended
        raise Refused(303, "sign in again", {"Location": f"{root}/login?problem=sign+in+again"})
    if who is None and not login and (unsafe or not readable):
        raise Refused(401, "missing or wrong bearer token", {"WWW-Authenticate": "Bearer"})
    if who == "read" and unsafe:
        raise Refused(403, "a read token only reads")


def _within(length: str, limit: int) -> None:
    """Refuse a body whose ``Content-Length`` says it is over ``limit`` bytes, unread."""
    if length.isascii() and length.isdigit() and (len(length) > 18 or int(length) > limit):
        raise Refused(413, f"the request body is {length} bytes; the limit is {limit}")


async def _read(receive: Receive, limit: int, scan: DepthScan | None) -> bytes:
    """The body, counted against ``limit`` as it streams and depth-scanned piece by piece, the
    loop free for other requests between pieces (once too deep, the rest is only counted: the
    client is answered after its whole body, so it reads the 422)."""
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
        if scan is not None:
            await _scan(scan, chunk)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _scan(scan: DepthScan, chunk: bytes) -> None:
    for start in range(0, len(chunk), PIECE):
        if start:
            await asyncio.sleep(0)
        scan.feed(chunk[start : start + PIECE])


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
