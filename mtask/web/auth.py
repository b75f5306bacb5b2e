"""Bearer-token auth for ``mtask serve``.

The token comes from ``MTASK_API_TOKEN`` or ``--token-file``. API clients send
``Authorization: Bearer <token>``; the dashboard's browser sends the same token in an HttpOnly,
SameSite=Strict cookie set by its login form (so cross-site pages cannot use it). Without a
token, ``mtask serve`` only binds to loopback.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
from pathlib import Path

from fastapi import HTTPException, Request

from mtask.errors import MtaskError

COOKIE = "mtask_token"
ENV = "MTASK_API_TOKEN"


class AuthConfigError(MtaskError):
    """The server cannot start with this token configuration."""


def load_token(token_file: str | None) -> str | None:
    if token_file:
        try:
            token = Path(token_file).read_text().strip()
        except OSError as exc:
            raise AuthConfigError(
                f"cannot read --token-file {token_file}: {exc.strerror}"
            ) from None
        if not token:
            raise AuthConfigError(f"--token-file {token_file} is empty")
        return token
    token = os.environ.get(ENV, "").strip()
    return token or None


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(host: str, token: str | None) -> None:
    if token is None and not is_loopback(host):
        raise AuthConfigError(
            f"refusing to serve on {host} without a token: set {ENV} or --token-file "
            "(only loopback may go without)"
        )


def presented(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, value = header.partition(" ")
    if scheme.lower() == "bearer" and value:
        return value.strip()
    return request.cookies.get(COOKIE)


def token_ok(request: Request) -> bool:
    expected: str | None = request.app.state.token
    if expected is None:
        return True
    given = presented(request)
    return given is not None and hmac.compare_digest(given.encode(), expected.encode())


async def require_token(request: Request) -> None:
    if not token_ok(request):
        raise HTTPException(
            status_code=401,
            detail="missing or wrong bearer token",
            headers={"WWW-Authenticate": "Bearer"},
        )
