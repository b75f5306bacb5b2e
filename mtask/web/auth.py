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

import base64
import hashlib
import hmac
import ipaddress
import os
import re
import secrets
import time
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import Request
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


def read_config(path: str, option: str) -> bytes:
    """A file an option names, stripped, or ``AuthConfigError`` saying why not."""
    try:
        return Path(path).read_bytes().strip()
    except OSError as exc:
        raise AuthConfigError(f"cannot read {option} {path}: {exc.strerror}") from None


def load_token(token_file: str | None) -> str | None:
    if token_file:
        token = read_config(token_file, "--token-file").decode(errors="replace")
        if not token:
            raise AuthConfigError(f"--token-file {token_file} is empty")
        return token
    token = os.environ.get(ENV, "").strip()
    return token or None


def load_read_secret(path: str | None) -> bytes | None:
    """``--read-token-secret-file``, else ``MTASK_READ_TOKEN_SECRET``, else None (read tokens
    refused)."""
    from mtask.security import read_tokens

    if path is None:
        return read_tokens.secret_from_env()
    secret = read_config(path, "--read-token-secret-file")
    if len(secret) < 16:
        raise AuthConfigError(f"--read-token-secret-file {path}: at least 16 bytes, please")
    return secret


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


ROLES = ("viewer", "operator", "admin")
"""The web roles, each allowed what the one before it is (``web/access.py`` says who may do
what)."""
TOKENS_ENV = "MTASK_API_TOKENS_FILE"


@dataclass(frozen=True)
class Principal:
    """Who calls: a token's (or its session's) role and name (the audit's *who*)."""

    role: str
    who: str

    def may(self, role: str) -> bool:
        return ROLES.index(self.role) >= ROLES.index(role)


LOOPBACK = Principal("admin", "loopback")
"""Who calls a serve without tokens (it listens on loopback only)."""


def load_tokens(path: str) -> dict[str, Principal]:
    """A tokens file: one ``ROLE NAME TOKEN`` a line (``#`` comments, blank lines skipped)."""
    lines = read_config(path, "--tokens-file").decode(errors="replace").splitlines()
    found: dict[str, Principal] = {}
    for number, line in enumerate(lines, 1):
        parts = line.split("#")[0].split()
        if not parts:
            continue
        if len(parts) != 3 or parts[0] not in ROLES or not BEARER.fullmatch(f"Bearer {parts[2]}"):
            raise AuthConfigError(
                f"--tokens-file {path}, line {number}: expected ROLE NAME TOKEN, ROLE one of "
                f"{', '.join(ROLES)} and TOKEN visible ASCII"
            )
        if parts[2] in found:
            raise AuthConfigError(f"--tokens-file {path}, line {number}: a token given twice")
        found[parts[2]] = Principal(parts[0], parts[1])
    if not found:
        raise AuthConfigError(f"--tokens-file {path} holds no token")
    return found


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def _b64(text: str) -> str:
    return base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")


def _unb64(text: str) -> str | None:
    try:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)).decode()
    except (ValueError, UnicodeDecodeError):
        return None


@dataclass(frozen=True)
class Keys:
    """The server's tokens (each a ``Principal``) and the HMAC key derived from them (a random
    key without a token). Tokens are looked up by their SHA-256 (no comparison that stops at
    the first differing byte)."""

    token: str | None
    """``MTASK_API_TOKEN``, the admin's (kept for the callers that name one token)."""
    key: bytes
    principals: Mapping[bytes, Principal] = field(default_factory=dict)

    @classmethod
    def of(cls, token: str | None, tokens: Mapping[str, Principal] | None = None) -> Keys:
        """``token`` is an admin's; ``tokens`` more, each with its role and name. Changing any
        token ends every session (the key is derived from all of them)."""
        every = dict(tokens or {})
        if token is not None:
            every.setdefault(token, Principal("admin", "admin"))
        if not every:
            return cls(None, secrets.token_bytes(32))
        secret = token if len(every) == 1 and token is not None else "\n".join(sorted(every))
        key = hmac.new(secret.encode(), b"mtask session key v1", "sha256").digest()
        return cls(token, key, {_digest(t): p for t, p in every.items()})

    @property
    def open(self) -> bool:
        """No token at all: loopback only, everyone an admin."""
        return not self.principals

    def _mac(self, purpose: str, value: str) -> str:
        return hmac.new(self.key, f"{purpose}:{value}".encode(), hashlib.sha256).hexdigest()

    def principal(self, given: str | None) -> Principal | None:
        """Whose token ``given`` is (``LOOPBACK`` without tokens), else None."""
        if self.open:
            return LOOPBACK
        return None if given is None else self.principals.get(_digest(given))

    def token_ok(self, given: str | None) -> bool:
        return self.principal(given) is not None

    def new_session(self, principal: Principal | None = None, now: float | None = None) -> str:
        """A session cookie for ``principal`` (the admin's by default)."""
        who = principal or Principal("admin", "admin")
        sid = secrets.token_urlsafe(18)
        expires = int((time.time() if now is None else now) + SESSION_SECONDS)
        body = f"{sid}.{expires}.{who.role}.{_b64(who.who)}"
        return f"{body}.{self._mac('session', body)}"

    def session(self, cookie: str | None, now: float | None = None) -> tuple[str, Principal] | None:
        """The session id and principal of a well-signed, unexpired session cookie."""
        if not cookie or cookie.count(".") != 4:
            return None
        sid, expires, role, who, signature = cookie.split(".")
        expected = self._mac("session", f"{sid}.{expires}.{role}.{who}")
        if not hmac.compare_digest(signature.encode(), expected.encode()):
            return None
        if not expires.isdigit() or int(expires) < (time.time() if now is None else now):
            return None
        name = _unb64(who)
        if role not in ROLES or name is None:
            return None
        return sid, Principal(role, name)

    def session_id(self, cookie: str | None, now: float | None = None) -> str | None:
        """The session id of a well-signed, unexpired session cookie, else None."""
        found = self.session(cookie, now)
        return None if found is None else found[0]

    def csrf(self, sid: str) -> str:
        return self._mac("csrf", sid)

    def login_csrf(self, nonce: str) -> str:
        return self._mac("login", nonce)

    def csrf_ok(self, sid: str, given: str | None, purpose: str = "csrf") -> bool:
        expected = self._mac(purpose, sid)
        return given is not None and hmac.compare_digest(given.encode(), expected.encode())


AUTH_FAILED = "mtask_auth_failed"
"""The request scope's key naming credentials that were given and refused (``web.rates``
counts each such request against its address)."""


def failed(scope: MutableMapping[str, Any], what: str) -> None:
    """Say that the request's credentials (``what``: a bearer token, a session, a read token,
    the sign-in form's token) were given and refused."""
    scope[AUTH_FAILED] = what


def signed_in(request: Request) -> bool:
    """A person or program with a role (a read token's holder is not signed in)."""
    return request.scope.get("mtask_principal") is not None


def principal_of(request: Request) -> Principal | None:
    found = request.scope.get("mtask_principal")
    return found if isinstance(found, Principal) else None


def csrf_of(request: Request) -> str:
    """The CSRF token for the request's session ('' when the request has none)."""
    sid = request.scope.get("mtask_sid")
    keys: Keys = request.app.state.keys
    return keys.csrf(sid) if isinstance(sid, str) else ""
