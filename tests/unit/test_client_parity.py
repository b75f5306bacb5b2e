"""The two clients are one API: every operation is written once (``client.operation``)."""

from __future__ import annotations

import inspect

from mtask.client import AsyncTaskClient, TaskClient, _Base, operation


def public(cls: type) -> set[str]:
    return {n for n in dir(cls) if not n.startswith("_")}


def test_both_clients_have_the_same_methods() -> None:
    assert public(TaskClient) - {"close"} == public(AsyncTaskClient) - {"close"}


def test_shared_methods_are_operations_run_or_awaited() -> None:
    ops = {n for n, v in vars(_Base).items() if isinstance(v, operation)}
    assert {"publish", "publish_many", "get", "list", "cancel", "retry", "purge"} <= ops
    sync = TaskClient.__new__(TaskClient)  # no connection: only the binding is looked at
    async_ = AsyncTaskClient.__new__(AsyncTaskClient)
    for name in ops:
        assert not inspect.iscoroutinefunction(getattr(sync, name)), name
        assert inspect.iscoroutinefunction(getattr(async_, name)), name
        assert getattr(sync, name).__doc__ == getattr(async_, name).__doc__
