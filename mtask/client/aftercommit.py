"""Run something once the caller's transaction has committed (``after_commit``).

A publish inside the caller's transaction creates its task only if that transaction commits;
what mtask counts of it (``mtask_published_total``) must wait for the commit too. pymongo has no
commit hook, so the first ``after_commit`` on a session wraps three of that session object's
own methods (not the class): ``start_transaction`` and ``abort_transaction`` drop the callbacks
waiting (the transaction they belonged to is over, or ``with_transaction`` starts it again and
the body registers them again), ``commit_transaction`` runs them once it returned without error
(a commit that raises keeps them: ``with_transaction`` retries a commit whose result is unknown).
Both ``with_transaction`` and ``with session.start_transaction():`` go through these methods.
A session not in a transaction runs the callback at once.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

_PENDING = "_mtask_after_commit"


def after_commit(session: Any, callback: Callable[[], None]) -> None:
    """Call ``callback`` now if ``session`` is None or not in a transaction, else once its
    current transaction commits (never if it aborts)."""
    if session is None or not getattr(session, "in_transaction", False):
        callback()
        return
    pending: list[Callable[[], None]] | None = getattr(session, _PENDING, None)
    if pending is None:
        pending = []
        setattr(session, _PENDING, pending)
        _hook(session, pending)
    pending.append(callback)


def _run(pending: list[Callable[[], None]]) -> None:
    callbacks = list(pending)
    pending.clear()
    for callback in callbacks:
        callback()


def _hook(session: Any, pending: list[Callable[[], None]]) -> None:
    start, commit, abort = (
        session.start_transaction,
        session.commit_transaction,
        session.abort_transaction,
    )
    if inspect.iscoroutinefunction(commit):

        async def astart(*args: Any, **kwargs: Any) -> Any:
            pending.clear()
            return await start(*args, **kwargs)

        async def acommit() -> None:
            await commit()
            _run(pending)

        async def aabort() -> None:
            pending.clear()
            await abort()

        hooks: tuple[Any, Any, Any] = (astart, acommit, aabort)
    else:

        def sstart(*args: Any, **kwargs: Any) -> Any:
            pending.clear()
            return start(*args, **kwargs)

        def scommit() -> None:
            commit()
            _run(pending)

        def sabort() -> None:
            pending.clear()
            abort()

        hooks = (sstart, scommit, sabort)
    for name, hook in zip(
        ("start_transaction", "commit_transaction", "abort_transaction"), hooks, strict=True
    ):
        setattr(session, name, hook)
