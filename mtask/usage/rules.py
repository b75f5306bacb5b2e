"""Usage's pure rules: one charge (``Usage``), a model's price (``Price``), a budget
(``Budget``) and its period, money in nano-units (``to_nanos``), a usage's line of text.

Tokens: ``input_tokens`` counts every token sent (the cached ones among them, as the providers
count them), ``output_tokens`` every token received, ``cached_tokens`` the input tokens read from
the provider's cache. A budget in tokens counts ``input_tokens + output_tokens``.

Money is counted in whole nano-units of the application's currency (``cost_nanos``, an integer:
10⁻⁹ of a unit), never in floating point: totals add up exactly on the server, and a budget's
comparison is exact. A cost given or priced is rounded to the nearest nano-unit once, per charge.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from decimal import ROUND_HALF_EVEN, Decimal, InvalidOperation
from typing import Any

from mtask.vocabulary import Period

KINDS = ("input", "output", "cached")
"""The kinds of token (``mtask_tokens_total{kind}``)."""
PERIODS = ("hour", "day", "week", "month")
"""A budget's named periods, on the server's clock, in UTC (a week starts on Sunday, as
MongoDB's ``$dateTrunc`` has it); a number of seconds is a period too (aligned on the epoch)."""
from mtask.vocabulary import MAX_COST, MAX_TOKENS  # noqa: E402

MAX_MODEL = 200
NANOS = 10**9
"""Nano-units per unit of the currency: money is counted in integers of these."""


def to_nanos(amount: object, field: str = "cost") -> int:
    """``amount`` of the currency (an int, float, ``Decimal`` or decimal string) in nano-units,
    rounded half to even; ``ValueError`` if it is not a number from 0 to ``MAX_COST``."""
    if isinstance(amount, bool) or not isinstance(amount, int | float | Decimal | str):
        raise ValueError(f"{field} must be a number from 0 to {MAX_COST:g}, not {amount!r}")
    try:
        value = Decimal(str(amount))
    except InvalidOperation:
        raise ValueError(f"{field} must be a number, not {amount!r}") from None
    if not value.is_finite() or not 0 <= value <= MAX_COST:
        raise ValueError(f"{field} must be a number from 0 to {MAX_COST:g}, not {amount!r}")
    return int((value * NANOS).to_integral_value(ROUND_HALF_EVEN))


def from_nanos(nanos: int | None) -> Decimal | None:
    """Nano-units as an exact ``Decimal`` of the currency (``None`` stays ``None``)."""
    return None if nanos is None else Decimal(int(nanos)).scaleb(-9)


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

    def cost_nanos(self, usage: Usage) -> int:
        """What ``usage`` costs at this price, in nano-units (computed in decimal, rounded
        once)."""
        cached = min(usage.cached_tokens, usage.input_tokens)
        fresh = usage.input_tokens - cached
        price = {k: Decimal(str(getattr(self, k))) for k in ("input", "output")}
        cached_price = price["input"] if self.cached is None else Decimal(str(self.cached))
        amount = (
            fresh * price["input"] + cached * cached_price + usage.output_tokens * price["output"]
        )
        return int((amount * NANOS / self.per).to_integral_value(ROUND_HALF_EVEN))


def _count(name: str, value: object, most: int = MAX_TOKENS) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= most:
        raise ValueError(f"{name} must be an integer from 0 to {most}, not {value!r}")
    return value


@dataclass(frozen=True)
class Usage:
    """One charge: what one model request (or any step) spent. ``cost_nanos`` is given (``of``:
    from a ``cost`` in the currency), or computed from the application's price for ``model``
    (``None``: no price known)."""

    model: str | None = None
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    requests: int = 1
    cost_nanos: int | None = None

    @classmethod
    def of(cls, model: str | None = None, *, cost: object = None, **counts: Any) -> Usage:
        """A charge from what a handler says: its counts, and its ``cost`` in the currency."""
        return cls(model, **counts, cost_nanos=None if cost is None else to_nanos(cost))

    @property
    def cost(self) -> Decimal | None:
        """The charge's cost in the currency, exactly (``None``: unknown)."""
        return from_nanos(self.cost_nanos)

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
        if self.cost_nanos is not None:
            _count("cost_nanos", self.cost_nanos, MAX_COST * NANOS)

    @property
    def tokens(self) -> int:
        """What a budget in tokens counts: every token sent and received."""
        return self.input_tokens + self.output_tokens

    def priced(self, prices: Mapping[str, Price]) -> Usage:
        """This charge with its cost from ``prices`` (when it has none and its model a price)."""
        if self.cost_nanos is not None or self.model is None or self.model not in prices:
            return self
        return replace(self, cost_nanos=prices[self.model].cost_nanos(self))

    def counts(self) -> dict[str, Any]:
        """The amounts a charge adds (the document's fields); ``cost_nanos`` only when known."""
        counts: dict[str, Any] = {
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "cached_tokens": self.cached_tokens,
            "requests": self.requests,
        }
        if self.cost_nanos is not None:
            counts["cost_nanos"] = self.cost_nanos
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


def usage_text(usage: Any) -> str:
    """A run's or task's usage (``UsageTotals``) in a line: its tokens, requests and cost (the
    CLI's ``mtask get``, the dashboard's task page)."""
    tokens = usage.input_tokens + usage.output_tokens
    cached = f", {usage.cached_tokens:,} cached" if usage.cached_tokens else ""
    requests = f"{usage.requests:,} request" + ("" if usage.requests == 1 else "s")
    text = f"{tokens:,} tokens ({usage.input_tokens:,} in{cached}, {usage.output_tokens:,} out)"
    text = f"{text}, {requests}"
    return text if usage.cost is None else f"{text}, cost {usage.cost.normalize():f}"
