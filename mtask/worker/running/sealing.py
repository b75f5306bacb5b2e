"""What a handler is given and what its run stores, for encrypted tasks
(``mtask.security.encryption``): ``Plain`` passes params and results through (a worker without a
key: it costs nothing); ``Sealed`` decrypts a task's encrypted params for its handler only, and
encrypts the result of a task whose params were encrypted. Decryption runs in a thread
(libmongocrypt may read the key vault), never on the event loop."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping
from typing import Any, Protocol

from mtask.security.encryption import KEY_FILE_ENV, KEY_VAULT, Encryption, read_key_file, sealed


class Sealing(Protocol):
    async def params(self, doc: Mapping[str, Any]) -> Any:
        """The params the handler is given."""
        ...

    def result(self, doc: Mapping[str, Any], result: Any) -> Any:
        """The result the run stores."""
        ...


class Plain:
    async def params(self, doc: Mapping[str, Any]) -> Any:
        return doc.get("params") or {}

    def result(self, doc: Mapping[str, Any], result: Any) -> Any:
        return result


class Sealed:
    def __init__(self, encryption: Encryption) -> None:
        self.encryption = encryption

    async def params(self, doc: Mapping[str, Any]) -> Any:
        params = doc.get("params") or {}
        if not sealed(params):
            return params
        return await asyncio.to_thread(self.encryption.open, params)

    def result(self, doc: Mapping[str, Any], result: Any) -> Any:
        if result is None or not sealed(doc.get("params")):
            return result
        return self.encryption.seal(result)


def from_env(mongo: Any, database: str) -> Sealing:
    """``Sealed`` with the local master key of ``MTASK_ENCRYPTION_KEY_FILE`` (the key vault
    ``<database>.mtask_keys``, read through ``mongo``, a sync client), else ``Plain``."""
    path = os.environ.get(KEY_FILE_ENV)
    if not path:
        return Plain()
    key = read_key_file(path)
    vault = f"{database}.{KEY_VAULT}"
    return Sealed(Encryption(mongo, {"local": {"key": key}}, key_vault=vault))
