"""Per-caller request rates on ``mtask serve`` (``--rate-limit``): a token bucket per caller —
a token's name, a read token, else the client's address — refilled at ``rate`` a second up to
``burst``; a request past it is ``429`` with ``Retry-After`` (whole seconds). Off unless set:
then nothing is counted. The health check and static files are not counted. The buckets are
this process's (several serves: each counts its own).

Failed authentications are counted too, by address, in a bucket of their own (``Failures``,
which runs before the guard): a wrong or malformed bearer token, a session cookie that is
forged, expired or signed before a token changed, a forged, expired or unverifiable read token,
a wrong token in the sign-in form (each marked by ``auth.failed``). Once an address's bucket is
empty, every request from it (but the exempt ones) is ``429`` before anything else is done, its
credentials unread — a guess cannot be tried, right or wrong — until the bucket refills. Before
authentication a request costs serve at most a pass over its headers (a token hashed once, a
cookie's HMAC), and the sign-in form's ``LOGIN_MAX_BODY`` bytes (``web.guard``)."""

from __future__ import annotations

import json
import math
import time
from collections import OrderedDict
from collections.abc import Callable

from mtask.web.auth import AUTH_FAILED, Principal
from mtask.web.guard import App, Receive, Scope, Send, client_address, route_path

EXEMPT = ("/healthz", "/static/", "/favicon.ico")
MAX_CALLERS = 10_000
"""Buckets kept (the least recently seen go first): memory stays bounded whoever calls."""


def caller(scope: Scope) -> str:
    principal = scope.get("mtask_principal")
    if isinstance(principal, Principal):
        return f"token:{principal.role}:{principal.who}"
    token = scope.get("mtask_read_token")
    if isinstance(token, str):
        return f"read:{token.rpartition('.')[2]}"
    client = scope.get("client")
    return f"address:{client[0] if client else 'unknown'}"


class Buckets:
    """Token buckets by caller (pure: the clock is given)."""

    def __init__(
        self, rate: float, burst: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.rate, self.burst, self.clock = rate, burst, clock
        self._held: OrderedDict[str, tuple[float, float]] = OrderedDict()

    def wait(self, who: str) -> float:
        """The seconds before ``who`` may make a request (0: now), nothing taken."""
        tokens, then = self._held.get(who, (float(self.burst), self.clock()))
        tokens = min(float(self.burst), tokens + (self.clock() - then) * self.rate)
        return 0.0 if tokens >= 1 else (1 - tokens) / self.rate

    def take(self, who: str) -> float:
        """0 if ``who`` may make a request now (one token taken), else the seconds to wait."""
        now = self.clock()
        tokens, then = self._held.pop(who, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - then) * self.rate)
        wait = 0.0 if tokens >= 1 else (1 - tokens) / self.rate
        self._held[who] = (tokens - 1 if not wait else tokens, now)
        if len(self._held) > MAX_CALLERS:
            self._held.popitem(last=False)
        return wait


class Rates:
    def __init__(self, app: App, *, buckets: Buckets) -> None:
        self.app, self.buckets = app, buckets

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or route_path(scope).startswith(EXEMPT):
            await self.app(scope, receive, send)
            return
        wait = self.buckets.take(caller(scope))
        if not wait:
            await self.app(scope, receive, send)
            return
        await too_many(send, wait)


class Failures:
    """The failed authentications' rate, by address: once the address's bucket is empty, 429
    before the guard reads anything; after each request whose credentials were refused, one
    token taken."""

    def __init__(self, app: App, *, buckets: Buckets, trust_proxy: bool = False) -> None:
        self.app, self.buckets, self.trust_proxy = app, buckets, trust_proxy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or route_path(scope).startswith(EXEMPT):
            await self.app(scope, receive, send)
            return
        who = f"failed:{client_address(scope, self.trust_proxy)}"
        wait = self.buckets.wait(who)
        if wait:
            await too_many(send, wait)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            if scope.get(AUTH_FAILED):
                self.buckets.take(who)


async def too_many(send: Send, wait: float) -> None:
    after = str(max(1, math.ceil(wait)))
    payload = json.dumps({"detail": f"too many requests: try again in {after} s"}).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(payload)).encode()),
        (b"retry-after", after.encode()),
    ]
    await send({"type": "http.response.start", "status": 429, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
