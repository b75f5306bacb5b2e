"""How a run's failure is told: its traceback as stored, what a handler's ``Fail`` or ``Retry``
says, and why a result is not stored. One wording for a run on the loop, on a thread and in a
child process (``pool/child.py`` imports this; nothing here imports the pool)."""

from __future__ import annotations

import traceback

TRACEBACK_LIMIT = 4000
"""The most characters of a failed run's traceback that are stored (the end is kept): one
limit for a run in a thread and one in a child."""


def short_traceback(exc: BaseException) -> str:
    text = "".join(traceback.format_exception(exc))
    return text if len(text) <= TRACEBACK_LIMIT else "…" + text[-TRACEBACK_LIMIT:]


def class_path(exc: BaseException) -> str:
    """The importable path of ``exc``'s class (``builtins.ValueError``, ``shop.errors.OutOfStock``),
    recorded on a FAIL run beside its traceback (``error_class``)."""
    kind = type(exc)
    return f"{kind.__module__}.{kind.__qualname__}"


def said(exc: BaseException) -> str:
    """What a handler's ``Fail`` or ``Retry`` says: ``str(exc)``, or what ``traceback`` says of
    an exception whose ``__str__`` raises (a subclass's: it left its run with no outcome, its
    task RUNNING until its lease ran out; in a child, it ended the child)."""
    try:
        return str(exc)
    except Exception:  # noqa: BLE001 - the handler's exception, not the worker's
        return "<exception str() failed>"


def result_too_large(size: int, limit: int) -> str:
    """Why a result of ``size`` bytes as BSON is not stored: a thread's run and a child's."""
    return f"the result is {size} bytes as BSON; the limit is {limit}"
