"""Encrypted params and results: MongoDB's explicit client-side field-level encryption
(``pymongo[encryption]``, which brings ``pymongocrypt`` and libmongocrypt; the ``encryption``
extra).

A task asks for it by its publish (``publish(..., encrypt=True)``) or its name
(``Encryption(..., names={"charge"})``). Its params are then stored as ``{MARK: <BinData
subtype 6>}``: the whole params document encrypted with ``AEAD_AES_256_CBC_HMAC_SHA_512-Random``
under the data key named ``ALT_NAME`` in the key vault (``<database>.mtask_keys``, beside the
tasks, so a role of that database can read it: ``mtask.security.roles``). The data key is itself
encrypted by the master key: a local 96-byte key file (``MTASK_ENCRYPTION_KEY_FILE``), or any
KMS provider MongoDB's drivers support (``kms_providers``, ``master_key``: AWS, Azure, GCP,
KMIP). A worker holding the key decrypts the params for the handler only, and encrypts the
result of a task whose params were encrypted (its result is then one ``BinData`` subtype 6);
readers without the key show ``encrypted`` (``shown``). Any MongoDB driver with explicit
encryption can publish such a task: encrypt the params document with the same data key and
algorithm, and store it under ``MARK``.

What is not encrypted: the name, key, options, group, error messages, step results and output
lines (the handler decides what it writes there). Rotation: ``rotate`` re-wraps every data key
under a new master key (``rewrapManyDataKey``); the data keys, and so every stored ciphertext,
stay the same, so old tasks stay readable.

A worker that cannot decrypt a task (no key, a wrong key, the key before a rotation) gives it
back without spending a retry and says why (``mtask.worker.running.sealing``); its claims then
skip the tasks it gave back (``mtask.store.claims.unopened_by``).

Cost: nothing for a task that does not ask (one dictionary lookup in the worker, none in a
publisher without encryption); for one that does, one encryption per publish and one
decryption per run (the data key is cached by libmongocrypt, read from the vault at most once a
minute).
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from bson.binary import STANDARD, Binary
from bson.codec_options import CodecOptions

from mtask.errors import ConfigError

MARK = "__mtask_encrypted__"
"""The one field of an encrypted params document; its value the ciphertext."""
ALT_NAME = "mtask"
KEY_VAULT = "mtask_keys"
KEY_FILE_ENV = "MTASK_ENCRYPTION_KEY_FILE"
ALGORITHM = "AEAD_AES_256_CBC_HMAC_SHA_512-Random"
ENCRYPTED_SUBTYPE = 6
SHOWN = "encrypted"
"""What a reader without the key shows for encrypted params or results."""
UNOPENED = "not decrypted by worker"
"""How the reason kept on a run starts when its worker could not decrypt its task's params and
gave it back (``mtask.worker.running.sealing``, read by ``mtask.explain.states``)."""


def is_ciphertext(value: Any) -> bool:
    return isinstance(value, Binary) and value.subtype == ENCRYPTED_SUBTYPE


def key_id_of(ciphertext: Binary) -> Binary | None:
    """The id of the data key that encrypted ``ciphertext`` (explicit encryption's layout: one
    byte of blob subtype, then the key's 16-byte UUID), or ``None`` if it is too short."""
    raw = bytes(ciphertext)
    return Binary(raw[1:17], 4) if len(raw) > 17 else None


def sealed(value: Any) -> bool:
    """Whether ``value`` is an encrypted params document or an encrypted result."""
    if isinstance(value, Mapping):
        return len(value) == 1 and is_ciphertext(value.get(MARK))
    return is_ciphertext(value)


def shown(value: Any) -> Any:
    """``value``, or ``"encrypted"`` for a reader that cannot decrypt it."""
    return SHOWN if sealed(value) else value


def read_key_file(path: str | os.PathLike[str]) -> bytes:
    """A local master key: 96 bytes, raw or base64 (``openssl rand -base64 96``)."""
    import base64

    try:
        data = Path(path).read_bytes().strip()
    except OSError as exc:
        raise ConfigError(f"cannot read the encryption key file {path}: {exc.strerror}") from None
    if len(data) != 96:
        try:
            data = base64.b64decode(data, validate=True)
        except ValueError:
            data = b""
    if len(data) != 96:
        raise ConfigError(f"the encryption key file {path} must hold 96 bytes (raw or base64)")
    return data


class Encryption:
    """Encrypts and decrypts params and results with one data key (``ALT_NAME``) of the key
    vault, through pymongo's ``ClientEncryption`` on ``mongo`` (a sync ``MongoClient`` that
    may read the vault)."""

    def __init__(
        self,
        mongo: Any,
        kms_providers: Mapping[str, Any],
        *,
        key_vault: str,
        provider: str = "local",
        master_key: Mapping[str, Any] | None = None,
        names: Collection[str] = (),
        key_alt_name: str = ALT_NAME,
        owns_client: bool = False,
    ) -> None:
        from pymongo.encryption import ClientEncryption
        from pymongo.errors import ConfigurationError

        self.mongo, self.provider, self.master_key = mongo, provider, master_key
        self.owns_client = owns_client
        """``mongo`` was made for this (``local``): a ``TaskClient`` closing closes it."""
        self.names = frozenset(names)
        """Names whose every publish is encrypted."""
        self.key_alt_name, self.key_vault = key_alt_name, key_vault
        try:
            self._ce: Any = ClientEncryption(
                dict(kms_providers), key_vault, mongo, CodecOptions(uuid_representation=STANDARD)
            )
        except ConfigurationError as exc:  # pymongocrypt missing, or a provider misconfigured
            raise ConfigError(f"cannot encrypt: {exc}") from None

    @classmethod
    def local(
        cls,
        key_file: str | os.PathLike[str],
        uri: str | None = None,
        database: str = "mtask",
        names: Collection[str] = (),
    ) -> Encryption:
        """With a local master key file, the key vault ``<database>.mtask_keys``."""
        from mtask.connection.clients import sync_client

        key = read_key_file(key_file)
        mongo = sync_client(uri)
        vault = f"{database}.{KEY_VAULT}"
        return cls(mongo, {"local": {"key": key}}, key_vault=vault, names=names, owns_client=True)

    @classmethod
    def from_env(cls, uri: str | None, database: str) -> Encryption | None:
        """``local`` with ``MTASK_ENCRYPTION_KEY_FILE``, if it is set."""
        path = os.environ.get(KEY_FILE_ENV)
        return cls.local(path, uri, database) if path else None

    def close(self) -> None:
        """Its ``ClientEncryption``, and ``mongo`` if it was made for it (``local``)."""
        self._ce.close()
        if self.owns_client:
            self.mongo.close()

    def ensure_key(self) -> Any:
        """The data key named ``key_alt_name``, made if missing (with the vault's unique index on
        ``keyAltNames``); returns its id."""
        database, _, collection = self.key_vault.partition(".")
        vault = self.mongo[database][collection]
        vault.create_index(
            "keyAltNames",
            unique=True,
            partialFilterExpression={"keyAltNames": {"$exists": True}},
        )
        found = self._ce.get_key_by_alt_name(self.key_alt_name)
        if found is not None:
            return found["_id"]
        return self._ce.create_data_key(
            self.provider, master_key=self.master_key, key_alt_names=[self.key_alt_name]
        )

    def wants(self, name: str, asked: bool) -> bool:
        return asked or name in self.names

    def seal(self, value: Any) -> Binary:
        encrypted: Binary = self._ce.encrypt(value, ALGORITHM, key_alt_name=self.key_alt_name)
        return encrypted

    def seal_params(self, params: Mapping[str, Any]) -> dict[str, Any]:
        return {MARK: self.seal(dict(params))}

    def open(self, value: Any) -> Any:
        """``value`` decrypted if it is sealed (params or a result), else as it is."""
        if isinstance(value, Mapping) and sealed(value):
            return self._ce.decrypt(value[MARK])
        if is_ciphertext(value):
            return self._ce.decrypt(value)
        return value

    def opens_key_of(self, ciphertext: Binary) -> str | None:
        """Whether this master key opens the data key that encrypted ``ciphertext`` (its id,
        bytes 1 to 16 of the ciphertext): ``None`` if it does, else why not (a wrong master key,
        the key before a rotation, a data key missing from the vault). An encryption with that
        data key is the test: it unwraps the data key and nothing else."""
        from pymongo.errors import EncryptionError

        key_id = key_id_of(ciphertext)
        if key_id is None:
            return None  # not a ciphertext this can tell anything about: its own error stands
        try:
            self._ce.encrypt("probe", ALGORITHM, key_id=key_id)
        except EncryptionError as exc:
            hint = " (a wrong master key, or the one from before a rotation)"
            said = f"cannot open its data key {key_id.as_uuid()}: {exc}"
            return said + hint if "HMAC" in str(exc) else said
        return None

    def rotate(
        self, provider: str | None = None, master_key: Mapping[str, Any] | None = None
    ) -> int:
        """Re-wrap every data key of the vault under the master key of ``provider`` (the
        ``kms_providers`` given, which must hold the old and the new key's provider); returns
        how many keys were re-wrapped. Ciphertexts need no change."""
        done = self._ce.rewrap_many_data_key({}, provider=provider, master_key=master_key)
        result = done.bulk_write_result
        return 0 if result is None else int(result.modified_count)


def rotate_local(mongo: Any, old: bytes, new: bytes, key_vault: str) -> int:
    """Re-wrap every data key of ``key_vault`` from the local master key ``old`` to ``new``,
    keeping the provider's name ``local`` (so ``Encryption.local`` and the workers'
    ``MTASK_ENCRYPTION_KEY_FILE`` read it with the new key file): through a named provider
    (``local:rotating``) and back, two ``rewrapManyDataKey``. Returns how many keys."""
    rotating = {"local": {"key": old}, "local:rotating": {"key": new}}
    back = {"local:rotating": {"key": new}, "local": {"key": new}}
    done = 0
    for providers, to in ((rotating, "local:rotating"), (back, "local")):
        step = Encryption(mongo, providers, key_vault=key_vault)
        try:
            count = step.rotate(to)
        finally:
            step.close()
        done = done or count
    return done
