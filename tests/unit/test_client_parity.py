"""The two clients are one API: every operation is written once (``client.core.operation``), in
one part of the client (``client.api.PARTS``), and named once in ``client.api.Operations``."""

from __future__ import annotations

import inspect

from mtask.client import AsyncTaskClient, TaskClient
from mtask.client.api import PARTS, Operations
from mtask.client.core import operation


def public(cls: type) -> set[str]:
    return {n for n in dir(cls) if not n.startswith("_")}


def test_both_clients_have_the_same_methods() -> None:
    assert public(TaskClient) - {"close"} == public(AsyncTaskClient) - {"close"}


def test_shared_methods_are_operations_run_or_awaited() -> None:
    ops = {n for n, v in vars(Operations).items() if isinstance(v, operation)}
    assert {"publish", "publish_many", "get", "list", "cancel", "retry", "purge"} <= ops
    sync = TaskClient.__new__(TaskClient)  # no connection: only the binding is looked at
    async_ = AsyncTaskClient.__new__(AsyncTaskClient)
    for name in ops:
        assert not inspect.iscoroutinefunction(getattr(sync, name)), name
        assert inspect.iscoroutinefunction(getattr(async_, name)), name
        assert getattr(sync, name).__doc__ == getattr(async_, name).__doc__


def test_every_operation_of_a_part_is_offered_once_under_its_name() -> None:
    """An operation written in a part and missing from ``Operations`` would be unreachable; one
    named there under another name, or from another part, would be two names for one thing."""
    written = {
        (part, name): value
        for part in PARTS
        for name, value in vars(part).items()
        if isinstance(value, operation)
    }
    offered = {
        name: value for name, value in vars(Operations).items() if isinstance(value, operation)
    }
    assert sorted(name for _, name in written) == sorted(offered)
    for (part, name), value in written.items():
        assert offered[name] is value and value.part is part, name


def test_an_operation_runs_on_the_clients_own_part() -> None:
    """Each client builds its parts once, on its own ``Core``: two clients share none."""
    one, two = TaskClient.__new__(TaskClient), TaskClient.__new__(TaskClient)
    for client in (one, two):
        Operations.__init__(client, "db", "tasks", None, 1000, None, None, mongo=None)
    assert set(one._parts) == set(PARTS)
    for part in PARTS:
        assert isinstance(one._parts[part], part)
        assert one._parts[part].core is one._core is not two._core
        assert one._parts[part] is not two._parts[part]
