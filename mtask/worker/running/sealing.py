"""What a handler is given and what its run stores, for encrypted tasks
(``mtask.security.encryption``): ``Plain`` passes params and results through (a worker without a
key: it costs nothing); ``Sealed`` decrypts a task's encrypted params for its handler only, and
encrypts the result of a task whose params were encrypted. Decryption runs in a thread
(libmongocrypt may read the key vault), never on the event loop.

A worker that cannot decrypt a task's params (no key: ``Plain``; a master key that does not
open the data key: a wrong key, or the key before a rotation) raises ``Unopened`` instead of
calling the handler: the run is released without spending a retry (``HandlerCalls``), its
reason kept on the run, and the worker's log says so once per name and reason. A handler never
sees ciphertext. A ciphertext that its own data key cannot decrypt (corrupt) is the task's
failure, as any error."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from mtask.security.encryption import (
    KEY_FILE_ENV,
    KEY_VAULT,
    MARK,
    Encryption,
    read_key_file,
    sealed,
)

log = logging.getLogger(__name__)

NO_KEY = "this worker has no encryption key (MTASK_ENCRYPTION_KEY_FILE is not set)"


class Unopened(Exception):
    """This worker cannot decrypt the task's params (or seal its result): the run gives the
    task back without spending a retry."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


class _KeyClosed(Exception):
    """From the decrypting thread: this worker's master key does not open the data key."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


class _Said:
    """What a worker logged of the tasks it could not decrypt: once per name and reason, not
    once per task; ``met`` tells its claims to skip the tasks it gave back."""

    def __init__(self, met: Callable[[], None] = lambda: None) -> None:
        self.said: set[tuple[str, str]] = set()
        self.met = met

    def refuse(self, doc: Mapping[str, Any], why: str, kind: str) -> Unopened:
        self.met()
        name = str(doc.get("name"))
        if (name, kind) not in self.said:
            self.said.add((name, kind))
            log.warning(
                "cannot decrypt the params of `%s` tasks: %s; giving each back once without "
                "spending a retry, for a worker that holds the key (said once per name)",
                name,
                why,
                extra={"task_name": name, "key": doc.get("_id")},
            )
        return Unopened(why)


class Sealing(Protocol):
    async def params(self, doc: Mapping[str, Any]) -> Any:
        """The params the handler is given."""
        ...

    def result(self, doc: Mapping[str, Any], result: Any) -> Any:
        """The result the run stores."""
        ...

    def renewed(self, doc: Mapping[str, Any], params: Mapping[str, Any]) -> Any:
        """The params a run that continues as new stores (``ctx.continue_as_new``)."""
        ...


class Plain(_Said):
    async def params(self, doc: Mapping[str, Any]) -> Any:
        params = doc.get("params") or {}
        if sealed(params):  # a type check and a lookup for a plain task
            raise self.refuse(doc, NO_KEY, "no key")
        return params

    def result(self, doc: Mapping[str, Any], result: Any) -> Any:
        return result

    def renewed(self, doc: Mapping[str, Any], params: Mapping[str, Any]) -> Any:
        return params  # a plain worker never ran an encrypted task's handler


class Sealed(_Said):
    def __init__(self, encryption: Encryption, met: Callable[[], None] = lambda: None) -> None:
        super().__init__(met)
        self.encryption = encryption

    async def params(self, doc: Mapping[str, Any]) -> Any:
        params = doc.get("params") or {}
        if not sealed(params):
            return params
        try:
            return await asyncio.to_thread(self._open, params)
        except _KeyClosed as closed:  # said and told on the event loop, the parts' owner
            raise self.refuse(doc, closed.why, "key") from None

    def _open(self, params: Mapping[str, Any]) -> Any:
        from pymongo.errors import EncryptionError

        try:
            return self.encryption.open(params)
        except EncryptionError:
            why = self.encryption.opens_key_of(params[MARK])
            if why is None:
                raise  # the key opens: the ciphertext itself is bad, the task's failure
            raise _KeyClosed(why) from None

    def result(self, doc: Mapping[str, Any], result: Any) -> Any:
        from pymongo.errors import EncryptionError

        if result is None or not sealed(doc.get("params")):
            return result
        try:
            return self.encryption.seal(result)
        except EncryptionError as exc:  # the key was rotated away while the handler ran
            raise self.refuse(doc, f"cannot encrypt its result: {exc}", "seal") from None

    def renewed(self, doc: Mapping[str, Any], params: Mapping[str, Any]) -> Any:
        """An encrypted task's new params encrypted as a publish encrypts them (``{MARK:
        ciphertext}``); a plain task's as they are."""
        from pymongo.errors import EncryptionError

        if not sealed(doc.get("params")):
            return params
        try:
            return self.encryption.seal_params(params)
        except EncryptionError as exc:  # the key was rotated away while the handler ran
            raise self.refuse(doc, f"cannot encrypt its new params: {exc}", "seal") from None


def from_env(mongo: Any, database: str, met: Callable[[], None] = lambda: None) -> Sealing:
    """``Sealed`` with the local master key of ``MTASK_ENCRYPTION_KEY_FILE`` (the key vault
    ``<database>.mtask_keys``, read through ``mongo``, a sync client), else ``Plain``; ``met``
    is called when a task cannot be decrypted here."""
    path = os.environ.get(KEY_FILE_ENV)
    if not path:
        return Plain(met)
    key = read_key_file(path)
    vault = f"{database}.{KEY_VAULT}"
    return Sealed(Encryption(mongo, {"local": {"key": key}}, key_vault=vault), met)
