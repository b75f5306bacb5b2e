"""Documents a worker sets aside: keys of any BSON type, noted to be marked ``invalid``.

Every value read from MongoDB is untrusted. A task's key is a string when mtask writes it, but
any service may insert a document whose ``_id`` is an object, a number, an ObjectId, a date,
binary data or a boolean. Such a key never enters the claim queue or any set or dict keyed by
task: it is noted here, as it is, and the scanner's ``quarantine`` marks its document
``invalid`` with the reason (``store.quarantine``). A key whose document cannot even be marked
is let go with a logged reason and counted in ``mtask_documents_set_aside`` (``unmarkable``).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from typing import Any

from mtask import metrics


def task_key(value: Any) -> str | None:
    """``value`` if it can be a task's key in the claim queue (a string), else ``None``."""
    return value if isinstance(value, str) else None


def _identity(key: Any) -> Hashable:
    """A hashable stand-in for a key of any BSON type (an object ``_id`` is a dict). The type
    is part of it: 1, 1.0 and True are one Python key but three documents."""
    try:
        hash(key)
    except TypeError:
        return ("unhashable", repr(key))
    return (type(key), key)


class SetAside:
    """Keys noted for quarantine, of any type, each once."""

    def __init__(self) -> None:
        self._keys: dict[Hashable, Any] = {}

    def add(self, key: Any) -> None:
        self._keys[_identity(key)] = key

    def __bool__(self) -> bool:
        return bool(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def __iter__(self) -> Iterator[Any]:
        return iter(list(self._keys.values()))

    def take(self) -> list[Any]:
        """The keys noted so far, forgotten here."""
        keys, self._keys = list(self._keys.values()), {}
        return keys


def count(reason: str) -> None:
    """One event or document set aside (``reason``: ``event``, an error while applying one
    event; ``unmarkable``, a document that could not even be marked invalid)."""
    metrics.SET_ASIDE.labels(reason).inc()
