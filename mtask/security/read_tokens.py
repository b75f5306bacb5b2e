"""Read tokens: a signed, expiring permission to read one task (or a group's, or a parent's and
its children's), its progress and its output stream over ``mtask serve``, and nothing else
(pure: no I/O).

A token is ``mrt1.<payload>.<signature>``: the payload is base64url JSON ``{"s": scope, "e":
expiry}`` (seconds since the epoch, by the server's clock), the signature HMAC-SHA256 of it
under a key derived from the operator's secret (``MTASK_READ_TOKEN_SECRET``, given to the
publisher that makes tokens and to serve). Nothing is stored: rotating the secret revokes
every token at once; a single token cannot be revoked before it expires (keep ttl short).

Scopes (``Scope.covers``): ``task`` one key; ``group`` every task of one name and group
(``options.group``); ``tree`` a task and its children — today those whose ``parent`` is it
(its flow's next steps) or which depend on it (``depends_on``). A child spawned by its parent
 that records its ``parent`` is covered as it is; another relation is one more line
in ``covers``. A token that names a kind this version does not know is refused.
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import hmac
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mtask.errors import InvalidTask, MtaskError

PREFIX = "mrt1"
ENV = "MTASK_READ_TOKEN_SECRET"
MAX_TTL = 7 * 86400
"""The longest a token may live: a week."""
KINDS = ("task", "group", "tree")


class BadToken(MtaskError):
    """A read token that is malformed, forged (or signed with a rotated secret) or expired."""


@dataclass(frozen=True)
class Scope:
    kind: str
    key: str | None = None
    """``task``: the task; ``tree``: the parent."""
    name: str | None = None
    group: str | None = None

    def covers(self, doc: Mapping[str, Any] | None) -> bool:
        """Whether the task document ``doc`` is one this scope may read."""
        if doc is None:
            return False
        if self.kind == "task":
            return doc.get("_id") == self.key
        if self.kind == "group":
            options = doc.get("options")
            group = options.get("group") if isinstance(options, Mapping) else None
            return doc.get("name") == self.name and group == self.group
        depends = doc.get("depends_on")
        return (
            doc.get("_id") == self.key
            or doc.get("parent") == self.key
            or (isinstance(depends, list) and self.key in depends)
        )

    def to_json(self) -> dict[str, str]:
        return {k: v for k, v in vars(self).items() if v is not None}


def secret_from_env() -> bytes | None:
    value = os.environ.get(ENV, "")
    return value.encode() if value else None


def _key(secret: bytes) -> bytes:
    return hmac.new(secret, b"mtask read token v1", hashlib.sha256).digest()


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def check_ttl(ttl: object) -> float:
    if not isinstance(ttl, int | float) or isinstance(ttl, bool) or not 1 <= ttl <= MAX_TTL:
        raise InvalidTask(f"must be from 1 to {MAX_TTL} seconds, not {ttl!r}", field="ttl")
    return float(ttl)


def sign(secret: bytes, scope: Scope, expires: dt.datetime) -> str:
    payload = _b64(json.dumps({"s": scope.to_json(), "e": int(expires.timestamp())}).encode())
    signature = hmac.new(_key(secret), payload.encode(), hashlib.sha256).digest()
    return f"{PREFIX}.{payload}.{_b64(signature)}"


def is_read_token(text: str) -> bool:
    return text.startswith(f"{PREFIX}.")


def verify(secret: bytes, token: str, now: dt.datetime) -> Scope:
    """The token's scope, if it is well-formed, signed under ``secret`` and not expired at
    ``now`` (the server's time); else ``BadToken`` saying which."""
    parts = token.split(".")
    if len(parts) != 3 or parts[0] != PREFIX or len(token) > 4096:
        raise BadToken("not a read token")
    expected = hmac.new(_key(secret), parts[1].encode(), hashlib.sha256).digest()
    # the signature's text as signed, to the letter: base64 leaves the last character's low
    # bits unused, and a decoded comparison would take another spelling of it
    if not hmac.compare_digest(parts[2].encode(), _b64(expected).encode()):
        raise BadToken("read token refused: its signature does not match (a rotated secret?)")
    try:
        body = json.loads(_unb64(parts[1]))
        scope = Scope(**body["s"])
        expires = dt.datetime.fromtimestamp(int(body["e"]), dt.UTC)
    except (ValueError, TypeError, KeyError):
        raise BadToken("read token refused: its payload is malformed") from None
    if scope.kind not in KINDS:
        raise BadToken(f"read token refused: unknown scope {scope.kind!r}")
    if expires <= now:
        raise BadToken("read token refused: it expired")
    return scope


def scope_of(
    key: str | None, name: str | None = None, group: str | None = None, children: bool = False
) -> Scope:
    """The scope a caller asks for: a key (with ``children``: its tree), or a name and group."""
    if key is not None and (name is not None or group is not None):
        raise InvalidTask("give a key, or a name and a group, not both", field="key")
    if key is not None:
        if not isinstance(key, str) or not key:
            raise InvalidTask("must be a task's key", field="key")
        return Scope("tree" if children else "task", key=key)
    if children:
        raise InvalidTask("children go with a key", field="children")
    if not isinstance(name, str) or not isinstance(group, str) or not name or not group:
        raise InvalidTask("give a key, or a name and a group", field="key")
    return Scope("group", name=name, group=group)
