"""Usage and cost, measured (docs/usage.md): what a run spent (tokens, requests, money), charged
as it is spent, totalled per run, per task, per name and per group; budgets that stop a step
from starting once spent.

- ``rules``: pure: ``Usage`` (one charge), ``Price`` (a model's price, per million tokens),
  ``Budget`` (a limit in tokens or money, optionally per period), the period's arithmetic,
  money in nano-units (``BudgetExceeded``, a ``Fail``, is ``mtask.BudgetExceeded``);
- ``charges``: one run's ``RunUsage``: ``ctx.record_usage`` charges through a ``UsageStore``,
  and a step checks the budgets before it starts.

Their writes live in ``mtask.store.usage``; the worker's ``UsageStore`` in
``mtask.worker.running.usage_stores``.
"""

from typing import TYPE_CHECKING

from mtask._version import lazy_exports
from mtask.usage.rules import (
    KINDS,
    PERIODS,
    Price,
    Usage,
    next_period,
    period_start,
)

if TYPE_CHECKING:
    from mtask.models import Budget

# ``Budget`` is a pydantic model: imported on its first use (a worker's start loads no pydantic)
__getattr__, __dir__ = lazy_exports(__name__, {"mtask.models": ("Budget",)}, globals())

__all__ = [
    "KINDS",
    "PERIODS",
    "Budget",
    "Price",
    "Usage",
    "next_period",
    "period_start",
]
