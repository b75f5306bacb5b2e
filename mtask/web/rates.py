"""Per-caller request rates on ``mtask serve`` (``--rate-limit``): a token bucket per caller —
a token's name, a read token, else the client's address — refilled at ``rate`` a second up to
``burst``; a request past it is ``429`` with ``Retry-After`` (whole seconds). Off unless set:
then nothing is counted. The health check and static files are not counted. The buckets are
this process's (several serves: each counts its own)."""

from __future__ import annotations

import json
import math
import time
from collections import OrderedDict
from collections.abc import Callable

from mtask.web.auth import Principal
from mtask.web.guard import App, Receive, Scope, Send, route_path

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
        after = str(max(1, math.ceil(wait)))
        payload = json.dumps({"detail": f"too many requests: try again in {after} s"}).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(payload)).encode()),
            (b"retry-after", after.encode()),
        ]
        await send({"type": "http.response.start", "status": 429, "headers": headers})
        await send({"type": "http.response.body", "body": payload})
