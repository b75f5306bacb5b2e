"""Where mtask finds MongoDB, and how it connects.

``uri`` if given, else ``MTASK_MONGODB_URI``, else the embedded server (started on demand).
Connections use majority write concern and retryable writes, and return timezone-aware UTC
datetimes.
"""

from __future__ import annotations

import datetime as dt
import os
import re
from collections.abc import Mapping
from typing import Any

from bson.codec_options import CodecOptions, DatetimeConversion
from pymongo import AsyncMongoClient, MongoClient
from pymongo.errors import ConfigurationError, InvalidURI

from mtask.connection import lock_waits, sockets
from mtask.errors import StorageError

ENV_URI = "MTASK_MONGODB_URI"
CODEC_OPTIONS: CodecOptions[dict[str, Any]] = CodecOptions(
    tz_aware=True, tzinfo=dt.UTC, datetime_conversion=DatetimeConversion.DATETIME_CLAMP
)
"""How mtask decodes BSON, whoever made the client (a caller's own, too): timezone-aware UTC
datetimes, a date no Python date can hold clamped as ``CLIENT_OPTIONS`` says."""
CLIENT_OPTIONS: dict[str, Any] = {
    "tz_aware": True,
    "tzinfo": dt.UTC,
    "w": "majority",
    "retryWrites": True,
    "retryReads": True,
    "appname": "mtask",
    "serverSelectionTimeoutMS": 10_000,
    "datetime_conversion": "DATETIME_CLAMP",
}
"""Every mtask client's. A date before year 1 or after 9999 (valid BSON, which any service may
write) is read as the first or last date Python holds: PyMongo raised ``InvalidBSON`` for it,
which stopped a worker out of its scan, its change stream or a claim's reply (and every worker
the stream carried it to), and was a 500 or a traceback from every reader of its task."""
WORKER_CLIENT_OPTIONS: dict[str, Any] = {**CLIENT_OPTIONS, "heartbeatFrequencyMS": 60_000}
"""A worker's two clients (claims and streams; lease pings): ours, with each server checked
every 60 s instead of the driver's 10 s. A check is two ``hello`` commands (the monitor's and
the round-trip time's): 64 idle hosts asked the server 83 operations a second at 10 s and 56
at 60 s, 4.2-4.7 % and 3.2-3.4 % of a core (docs/journal/2026-11.md, "A worker's server
monitoring every 60 s"). Nothing waits on it:
the monitor hears of an election or a step-down at once (it streams ``hello``), and an
operation that fails, or waits for a server, makes the driver check at once (at most every
0.5 s). A URI that sets ``heartbeatFrequencyMS`` wins."""


def resolve_uri(uri: str | None = None) -> str:
    if uri:
        return uri
    env = os.environ.get(ENV_URI)
    if env:
        return env
    from mtask.embedded import EmbeddedMongo

    return EmbeddedMongo().start()


def redact(uri: str) -> str:
    """The URI with its password (and any ``…Password=`` option, such as a TLS key's) replaced
    by ``***``: what a log line, an error or a page may say about it."""
    scheme, sep, rest = uri.partition("://")
    if not sep:
        return "***" if "@" in uri or ":" in uri else uri
    hosts, slash, tail = rest.partition("/")
    if "@" in hosts and ":" in hosts.rpartition("@")[0]:
        user = hosts.rpartition("@")[0].partition(":")[0]
        hosts = f"{user}:***@{hosts.rpartition('@')[2]}"
    tail = re.sub(r"(?i)([?&][A-Za-z]*(?:password|secret|token)[A-Za-z]*=)[^&]*", r"\1***", tail)
    return f"{scheme}{sep}{hosts}{slash}{tail}"


def _check(uri: str) -> None:
    if not uri.startswith(("mongodb://", "mongodb+srv://")):
        raise StorageError(
            f"invalid MongoDB URI {redact(uri)!r}: it must start with mongodb:// or mongodb+srv://"
        )


def _options(
    uri: str, options: dict[str, Any], defaults: Mapping[str, Any] = CLIENT_OPTIONS
) -> dict[str, Any]:
    """``defaults``, except where the URI or the caller says otherwise."""
    query = uri.partition("?")[2].lower()
    merged = {k: v for k, v in defaults.items() if f"{k.lower()}=" not in query}
    return {**merged, **options}


def _said(exc: Exception, uri: str) -> str:
    """The driver's complaint about a URI, without the URI's password (pymongo may quote it)."""
    text = str(exc)
    password = _password(uri)
    return text.replace(password, "***") if password else text


def _password(uri: str) -> str:
    hosts = uri.partition("://")[2].partition("/")[0]
    if "@" not in hosts:
        return ""
    return hosts.rpartition("@")[0].partition(":")[2]


def sync_client(
    uri: str | None = None, *, defaults: Mapping[str, Any] = CLIENT_OPTIONS, **options: Any
) -> MongoClient[dict[str, Any]]:
    """A client with ``defaults`` (``CLIENT_OPTIONS``, or a worker's), except where the URI or
    ``options`` say otherwise."""
    resolved = resolve_uri(uri)
    _check(resolved)
    try:
        return MongoClient(resolved, **_options(resolved, options, defaults))
    except (ConfigurationError, InvalidURI, ValueError) as exc:
        raise StorageError(f"invalid MongoDB URI: {_said(exc, resolved)}") from None


def mend_pymongo() -> None:
    """Install mtask's workarounds for pymongo's asynchronous API, once, before an async
    client of mtask's is made: a cancelled connect closes its socket (``sockets``), and on
    Python 3.11 a cancelled condition wait takes its lock back (``lock_waits``)."""
    sockets.install()
    lock_waits.install()


def async_client(
    uri: str | None = None, *, defaults: Mapping[str, Any] = CLIENT_OPTIONS, **options: Any
) -> AsyncMongoClient[dict[str, Any]]:
    """A client with ``defaults`` (``CLIENT_OPTIONS``, or a worker's), except where the URI or
    ``options`` say otherwise."""
    resolved = resolve_uri(uri)
    _check(resolved)
    mend_pymongo()
    try:
        return AsyncMongoClient(resolved, **_options(resolved, options, defaults))
    except (ConfigurationError, InvalidURI, ValueError) as exc:
        raise StorageError(f"invalid MongoDB URI: {_said(exc, resolved)}") from None
