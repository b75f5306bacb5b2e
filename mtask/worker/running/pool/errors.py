"""How a run can end that is neither its handler's return nor its ``Retry``/``Fail``: the errors
the process pool raises (and ``invoke`` for a run on a thread: ``HandlerError``,
``TimeLimitExceeded``). ``RunOutcomes`` records each as the run's failure; ``ReplyRefused`` for
good. Below every module of the pool: ``pipe`` raises the first two, ``exchange`` the time
limit, ``pool`` the others."""

from __future__ import annotations

from mtask.errors import MtaskError


class HandlerError(MtaskError):
    """The handler raised in its child process (or, on a thread, something not an
    ``Exception``); the message is its traceback, ``error_class`` the importable path of the
    exception's class (the run's ``error_class``; None: the handler raised nothing)."""

    def __init__(self, message: str, error_class: str | None = None) -> None:
        super().__init__(message)
        self.error_class = error_class


class ReplyRefused(MtaskError):
    """What the child sent is over its bound (``pipe.Bounds``): a result too large to store,
    refused in the child, or a message the worker would not read (its child was killed). The
    run fails for good, as a thread's with that result does."""


class TimeLimitExceeded(MtaskError):
    """The run reached its hard time limit; its child was killed."""


class ChildDied(MtaskError):
    """The child process running the handler died (a signal, ``os._exit``, a kill)."""


class MemoryLimitExceeded(MtaskError):
    """The child's resident memory passed the pool's hard ``memory_limit``; it was killed."""
