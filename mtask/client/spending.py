"""A client's usage and budgets (docs/usage.md): what each name and group spent, and the
budgets of names and groups (``mtask.store.usage``)."""

from __future__ import annotations

import builtins
from typing import Any

from pydantic import ValidationError

from mtask.client.core import Core, operation
from mtask.driver import Doc, Op
from mtask.errors import InvalidTask
from mtask.models import Budget, describe_validation_error
from mtask.store import usage as store_usage


def _scopes(name: str | None, group: str | None) -> builtins.list[Doc]:
    scopes = [] if name is None else [store_usage.scope_id("name", name)]
    if group is not None:
        scopes.append(store_usage.scope_id("group", group))
    return scopes


def _one(name: str | None, group: str | None) -> Doc:
    scopes = _scopes(name, group)
    if len(scopes) != 1:
        raise InvalidTask("give a name or a group (one of them)", field="name")
    return scopes[0]


def scope_view(doc: Doc) -> dict[str, Any]:
    """A scope's document as the client, the CLI and the REST API show it."""
    view: dict[str, Any] = {"scope": doc["_id"]["scope"], "id": doc["_id"]["id"]}
    for field in store_usage.COUNTS:
        if field in doc:
            view[field] = doc[field]
    for field in ("budget", "window", "updated_at"):
        if field in doc:
            view[field] = doc[field]
    return view


class Spending:
    """What names and groups spent (``ctx.record_usage``), and their budgets."""

    def __init__(self, core: Core) -> None:
        self.core = core

    @operation
    def usage(
        self, name: str | None = None, group: str | None = None
    ) -> Op[builtins.list[dict[str, Any]]]:
        """The totals of ``name`` and/or ``group`` (every name's and group's without either):
        ``{scope, id, input_tokens, output_tokens, cached_tokens, requests, cost, budget,
        window}``, each as far as known."""
        scopes = _scopes(name, group)
        found = yield from store_usage.totals(scopes or None)
        return [scope_view(d) for d in found]

    @operation
    def set_budget(
        self,
        name: str | None = None,
        *,
        group: str | None = None,
        tokens: int | None = None,
        cost: float | None = None,
        period: str | float | None = None,
    ) -> Op[dict[str, Any]]:
        """Give task name ``name`` (or group ``group``, across names) a budget: at most
        ``tokens`` (input + output) and/or ``cost``, optionally per ``period`` (``"hour"``,
        ``"day"``, ``"week"``, ``"month"`` in UTC on the server's clock, or seconds). Past it
        a step does not start: the task fails with ``BudgetExceeded``, or, with a period, waits
        for the next one without holding a slot. Workers apply it within 5 seconds."""
        scope = _one(name, group)
        try:
            budget = Budget(tokens=tokens, cost=cost, period=period)
        except ValidationError as exc:
            raise InvalidTask(describe_validation_error(exc)) from None
        doc = yield from store_usage.set_budget(scope, budget)
        assert doc is not None
        return scope_view(doc)

    @operation
    def clear_budget(self, name: str | None = None, *, group: str | None = None) -> Op[bool]:
        """Remove the budget of ``name`` (or ``group``); its totals stay. ``False`` if it had
        none."""
        return (yield from store_usage.clear_budget(_one(name, group)))
