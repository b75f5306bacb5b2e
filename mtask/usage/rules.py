"""Usage's pure rules: one charge (``Usage``), a model's price (``Price``), a budget
(``Budget``) and its period, and the error a step past a budget raises (``BudgetExceeded``).

Tokens: ``input_tokens`` counts every token sent (the cached ones among them, as the providers
count them), ``output_tokens`` every token received, ``cached_tokens`` the input tokens read from
the provider's cache. A budget in tokens counts ``input_tokens + output_tokens``.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mtask.models import Budget, Period
from mtask.registry import Fail

KINDS = ("input", "output", "cached")
"""The kinds of token (``mtask_tokens_total{kind}``)."""
PERIODS = ("hour", "day", "week", "month")
"""A budget's named periods, on the server's clock, in UTC (a week starts on Sunday, as
MongoDB's ``$dateTrunc`` has it); a number of seconds is a period too (aligned on the epoch)."""
from mtask.models import MAX_COST, MAX_TOKENS  # noqa: E402

MAX_MODEL = 200


@dataclass(frozen=True)
class Price:
    """A model's price, in the application's currency per ``per`` tokens (a million, as the
    providers' price lists say). ``cached``: the price of an input token read from the cache
    (``None``: the input price)."""

    input: float
    output: float
    cached: float | None = None
    per: int = 1_000_000

    def __post_init__(self) -> None:
        for field in ("input", "output", "cached"):
            value = getattr(self, field)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0
            ):
                raise ValueError(f"Price.{field} must be a number >= 0, not {value!r}")
        if isinstance(self.per, bool) or not isinstance(self.per, int) or self.per < 1:
            raise ValueError(f"Price.per must be a positive integer, not {self.per!r}")

    def cost(self, usage: Usage) -> float:
        cached = min(usage.cached_tokens, usage.input_tokens)
        fresh = usage.input_tokens - cached
        cached_price = self.input if self.cached is None else self.cached
        return (
            fresh * self.input + cached * cached_price + usage.output_tokens * self.output
        ) / self.per


def _count(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TOKENS:
        raise ValueError(f"{name} must be an integer from 0 to {MAX_TOKENS}, not {value!r}")
    return value


@dataclass(frozen=True)
class Usage:
    """One charge: what one model request (or any step) spent. ``cost`` is given, or computed
    from the application's price for ``model`` (``None``: no price known)."""

    model: str | None = None
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    requests: int = 1
    cost: float | None = None

    def __post_init__(self) -> None:
        if self.model is not None and (
            not isinstance(self.model, str)
            or not 0 < len(self.model) <= MAX_MODEL
            or "\x00" in self.model
        ):
            raise ValueError(
                f"model must be a name of 1 to {MAX_MODEL} characters, not {self.model!r}"
            )
        for field in ("input_tokens", "output_tokens", "cached_tokens", "requests"):
            _count(field, getattr(self, field))
        if self.cost is not None and (
            isinstance(self.cost, bool)
            or not isinstance(self.cost, int | float)
            or not 0 <= self.cost <= MAX_COST
        ):
            raise ValueError(f"cost must be a number from 0 to {MAX_COST:g}, not {self.cost!r}")

    @property
    def tokens(self) -> int:
        """What a budget in tokens counts: every token sent and received."""
        return self.input_tokens + self.output_tokens

    def priced(self, prices: Mapping[str, Price]) -> Usage:
        """This charge with its cost from ``prices`` (when it has none and its model a price)."""
        if self.cost is not None or self.model is None or self.model not in prices:
            return self
        return Usage(
            self.model,
            self.input_tokens,
            self.output_tokens,
            self.cached_tokens,
            self.requests,
            prices[self.model].cost(self),
        )

    def counts(self) -> dict[str, Any]:
        """The amounts a charge adds (the document's fields); ``cost`` only when known."""
        counts: dict[str, Any] = {
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "cached_tokens": self.cached_tokens,
            "requests": self.requests,
        }
        if self.cost is not None:
            counts["cost"] = float(self.cost)
        return counts


def period_start(period: Period, now: dt.datetime) -> dt.datetime:
    """The start of the period holding ``now`` (as the server's ``$dateTrunc`` computes it)."""
    now = now.astimezone(dt.UTC)
    if not isinstance(period, str):
        ms = round(period * 1000)
        epoch_ms = math.floor(now.timestamp() * 1000)
        return dt.datetime.fromtimestamp((epoch_ms - epoch_ms % ms) / 1000, dt.UTC)
    day = now.replace(hour=0, minute=0, second=0, microsecond=0)
    if period == "hour":
        return now.replace(minute=0, second=0, microsecond=0)
    if period == "day":
        return day
    if period == "week":  # Sunday, as $dateTrunc's default startOfWeek
        return day - dt.timedelta(days=(day.weekday() + 1) % 7)
    return day.replace(day=1)


def next_period(period: Period, now: dt.datetime) -> dt.datetime:
    """The start of the period after the one holding ``now``."""
    start = period_start(period, now)
    if not isinstance(period, str):
        return start + dt.timedelta(milliseconds=round(period * 1000))
    if period == "month":
        return start.replace(year=start.year + start.month // 12, month=start.month % 12 + 1)
    step = {"hour": dt.timedelta(hours=1), "day": dt.timedelta(days=1)}
    return start + step.get(period, dt.timedelta(days=7))


class BudgetExceeded(Fail):
    """A step would have started past a budget: the task fails for good, naming the budget
    (``budget``: ``"task"``, ``"name:<name>"`` or ``"group:<group>"``)."""

    def __init__(self, budget: str, limit: Budget, spent: Mapping[str, Any]) -> None:
        tokens = int(spent.get("input_tokens") or 0) + int(spent.get("output_tokens") or 0)
        cost = spent.get("cost")
        shown = f"{tokens} tokens" + ("" if cost is None else f", a cost of {float(cost):g}")
        super().__init__(
            f"budget exceeded: the {budget} budget of {limit.describe()} ({shown} spent)"
        )
        self.budget = budget
        self.limit = limit
