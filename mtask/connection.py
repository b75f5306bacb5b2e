"""Where mtask finds MongoDB, and how it connects.

``uri`` if given, else ``MTASK_MONGODB_URI``, else the embedded server (started on demand).
Connections use majority write concern and retryable writes, and return timezone-aware UTC
datetimes.
"""

from __future__ import annotations

import datetime as dt
import os
from typing import Any

from bson.codec_options import CodecOptions
from pymongo import AsyncMongoClient, MongoClient
from pymongo.errors import ConfigurationError, InvalidURI

from mtask.errors import StorageError

ENV_URI = "MTASK_MONGODB_URI"
CODEC_OPTIONS: CodecOptions[dict[str, Any]] = CodecOptions(tz_aware=True, tzinfo=dt.UTC)
"""How mtask decodes BSON: timezone-aware UTC datetimes (the drivers and the stream relay)."""
CLIENT_OPTIONS: dict[str, Any] = {
    "tz_aware": True,
    "tzinfo": dt.UTC,
    "w": "majority",
    "retryWrites": True,
    "retryReads": True,
    "appname": "mtask",
    "serverSelectionTimeoutMS": 10_000,
}


def resolve_uri(uri: str | None = None) -> str:
    if uri:
        return uri
    env = os.environ.get(ENV_URI)
    if env:
        return env
    from mtask.embedded import EmbeddedMongo

    return EmbeddedMongo().start()


def _check(uri: str) -> None:
    if not uri.startswith(("mongodb://", "mongodb+srv://")):
        raise StorageError(
            f"invalid MongoDB URI {uri!r}: it must start with mongodb:// or mongodb+srv://"
        )


def _options(uri: str, options: dict[str, Any]) -> dict[str, Any]:
    """Our defaults, except where the URI or the caller says otherwise."""
    query = uri.partition("?")[2].lower()
    merged = {k: v for k, v in CLIENT_OPTIONS.items() if f"{k.lower()}=" not in query}
    return {**merged, **options}


def sync_client(uri: str | None = None, **options: Any) -> MongoClient[dict[str, Any]]:
    resolved = resolve_uri(uri)
    _check(resolved)
    try:
        return MongoClient(resolved, **_options(resolved, options))
    except (ConfigurationError, InvalidURI, ValueError) as exc:
        raise StorageError(f"invalid MongoDB URI: {exc}") from None


def async_client(uri: str | None = None, **options: Any) -> AsyncMongoClient[dict[str, Any]]:
    resolved = resolve_uri(uri)
    _check(resolved)
    try:
        return AsyncMongoClient(resolved, **_options(resolved, options))
    except (ConfigurationError, InvalidURI, ValueError) as exc:
        raise StorageError(f"invalid MongoDB URI: {exc}") from None
