"""Who may call ``mtask serve``: the bearer token, dashboard sessions and their CSRF tokens.

The token comes from ``MTASK_API_TOKEN`` or ``--token-file``. API clients send exactly
``Authorization: Bearer <token>`` (one space, nothing after the token), compared in constant
time. The dashboard signs in with the token once and gets a *session* cookie that is not the
token: ``<session id>.<expiry>.<signature>``, signed with HMAC-SHA256 under a key derived from
the token (so changing the token ends every session, and serve keeps no session table). The
cookie is ``HttpOnly``, ``SameSite=Strict``, expires after ``SESSION_SECONDS`` and is ``Secure``
when the request came over HTTPS (or a trusted proxy says it did).

Every state-changing request that a session cookie authorises must come from the dashboard's
own origin (``Origin``, else ``Referer``) and carry the session's CSRF token (an HMAC of the
session id) in the ``X-CSRF-Token`` header or the ``csrf`` form field. The login form is guarded
the same way by a pre-session pair: a random nonce cookie and its HMAC in the form. The checks
run in ``mtask.web.guard`` before any request body is read. Without a token, ``mtask serve``
only binds to loopback.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import re
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

from fastapi import HTTPException, Request
from fastapi.security import HTTPBearer

from mtask.errors import MtaskError

COOKIE = "mtask_session"
LOGIN_COOKIE = "mtask_login"
CSRF_HEADER = "x-csrf-token"
CSRF_FIELD = "csrf"
ENV = "MTASK_API_TOKEN"
SESSION_SECONDS = 12 * 3600
BEARER = re.compile(r"Bearer ([!-~]+)", re.IGNORECASE)
"""``Bearer``, one space, the token (visible ASCII, so no spaces) and nothing else."""
bearer_scheme = HTTPBearer(
    auto_error=False,
    description="`Authorization: Bearer <MTASK_API_TOKEN>` (the dashboard uses a session cookie)",
)


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


def bearer_of(header: str | None) -> str | None:
    """The token of a well-formed ``Authorization: Bearer <token>`` header, else None."""
    if header is None:
        return None
    match = BEARER.fullmatch(header)
    return match.group(1) if match else None


@dataclass(frozen=True)
class Keys:
    """The server's token and the HMAC key derived from it (a random key without a token)."""

    token: str | None
    key: bytes

    @classmethod
    def of(cls, token: str | None) -> Keys:
        if token is None:
            return cls(None, secrets.token_bytes(32))
        return cls(token, hmac.new(token.encode(), b"mtask session key v1", "sha256").digest())

    def _mac(self, purpose: str, value: str) -> str:
        return hmac.new(self.key, f"{purpose}:{value}".encode(), hashlib.sha256).hexdigest()

    def token_ok(self, given: str | None) -> bool:
        if self.token is None:
            return True
        return given is not None and hmac.compare_digest(given.encode(), self.token.encode())

    def new_session(self, now: float | None = None) -> str:
        sid = secrets.token_urlsafe(18)
        expires = int((time.time() if now is None else now) + SESSION_SECONDS)
        body = f"{sid}.{expires}"
        return f"{body}.{self._mac('session', body)}"

    def session_id(self, cookie: str | None, now: float | None = None) -> str | None:
        """The session id of a well-signed, unexpired session cookie, else None."""
        if not cookie or cookie.count(".") != 2:
            return None
        sid, expires, signature = cookie.split(".")
        expected = self._mac("session", f"{sid}.{expires}")
        if not hmac.compare_digest(signature.encode(), expected.encode()):
            return None
        if not expires.isdigit() or int(expires) < (time.time() if now is None else now):
            return None
        return sid

    def csrf(self, sid: str) -> str:
        return self._mac("csrf", sid)

    def login_csrf(self, nonce: str) -> str:
        return self._mac("login", nonce)

    def csrf_ok(self, sid: str, given: str | None, purpose: str = "csrf") -> bool:
        expected = self._mac(purpose, sid)
        return given is not None and hmac.compare_digest(given.encode(), expected.encode())


async def require_token(request: Request) -> None:
    """The route dependency: the guard already decided; this refuses what it left undecided
    (a safe request with no credentials) and puts the bearer scheme into the OpenAPI spec."""
    if request.scope.get("mtask_auth") is None:
        raise HTTPException(
            status_code=401,
            detail="missing or wrong bearer token",
            headers={"WWW-Authenticate": "Bearer"},
        )


def signed_in(request: Request) -> bool:
    return request.scope.get("mtask_auth") is not None


def csrf_of(request: Request) -> str:
    """The CSRF token for the request's session ('' when the request has none)."""
    sid = request.scope.get("mtask_sid")
    keys: Keys = request.app.state.keys
    return keys.csrf(sid) if isinstance(sid, str) else ""
