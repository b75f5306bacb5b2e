"""Usage's pure rules: money in nano-units (exact, rounded once), a price's cost, a charge's
checks, a budget's periods; and ``ctx.record_usage`` in ``mtask.testing`` (priced, in memory)."""

from __future__ import annotations

import datetime as dt
from decimal import Decimal
from typing import Any

import pytest

from mtask.models import Budget
from mtask.registry import Registry, TaskContext
from mtask.testing import arun_handler
from mtask.usage import Price, Usage, next_period, period_start
from mtask.usage.rules import to_nanos


def test_money_is_counted_in_nano_units_exactly() -> None:
    assert to_nanos(0.25) == 250_000_000 and to_nanos("0.000000001") == 1
    assert to_nanos(Decimal("0.0000000015")) == 2  # half to even, once
    assert to_nanos(0.1) + to_nanos(0.2) == to_nanos(0.3)  # no float drift in the sums
    for bad in (-1, float("nan"), float("inf"), "x", True, 10**10):
        with pytest.raises(ValueError, match="cost"):
            to_nanos(bad)
    assert Usage.of("m", cost=0.25).cost == Decimal("0.25")


def test_a_prices_cost_counts_cached_input_at_its_own_price() -> None:
    price = Price(input=0.15, output=0.60, cached=0.075)  # per million tokens
    usage = Usage("m", input_tokens=1000, output_tokens=100, cached_tokens=400)
    # 600 x 0.15 + 400 x 0.075 + 100 x 0.60 = 180 per million: 0.00018
    assert price.cost_nanos(usage) == 180_000
    assert usage.priced({"m": price}).cost == Decimal("0.00018")
    assert usage.priced({"other": price}).cost_nanos is None  # no price: no cost
    assert Price(1, 1).cost_nanos(Usage(input_tokens=3, cached_tokens=9)) == 3_000  # at most all
    with pytest.raises(ValueError, match="Price.input"):
        Price(-1, 0)


def test_a_charge_refuses_bad_amounts() -> None:
    for counts in ({"input_tokens": -1}, {"requests": 1.5}, {"cached_tokens": True}):
        with pytest.raises(ValueError):
            Usage("m", **counts)
    with pytest.raises(ValueError, match="model"):
        Usage("x" * 201)


def test_periods_start_on_the_utc_calendar_and_numbers_on_the_epoch() -> None:
    now = dt.datetime(2026, 12, 31, 23, 59, 30, tzinfo=dt.UTC)  # a Thursday
    assert period_start("hour", now) == now.replace(minute=0, second=0)
    assert period_start("day", now) == dt.datetime(2026, 12, 31, tzinfo=dt.UTC)
    assert period_start("week", now) == dt.datetime(2026, 12, 27, tzinfo=dt.UTC)  # Sunday
    assert next_period("month", now) == dt.datetime(2027, 1, 1, tzinfo=dt.UTC)
    assert next_period(60.0, now) == dt.datetime(2027, 1, 1, tzinfo=dt.UTC)
    with pytest.raises(ValueError, match="at least one"):
        Budget()
    assert Budget(cost=0.1).cost_nanos() == 100_000_000


registry = Registry()
registry.price("small", input=1.0, output=4.0)


async def _call(ctx: TaskContext) -> int:
    """A model's call: its usage recorded inside its step."""
    await ctx.record_usage("small", input_tokens=100, output_tokens=10)
    return 110


@registry.task("spend")
async def spend(params: dict[str, Any], ctx: TaskContext) -> str:
    for n in range(3):
        await ctx.step(f"s{n}", _call, ctx)
    return str(ctx.usage.cost_nanos)


@registry.task("bad")
async def bad(params: dict[str, Any], ctx: TaskContext) -> None:
    await ctx.record_usage("small", input_tokens=-5)


async def test_record_usage_in_a_handlers_test_is_priced_and_checked() -> None:
    done = await arun_handler(registry, "spend", {})
    assert done.result == str(3 * 140 * 1000), done  # 100 x 1 + 10 x 4 per million, x 3
    refused = await arun_handler(registry, "bad", {})
    assert refused.error is not None and "ctx.record_usage: input_tokens" in refused.error
    assert refused.error_class == "mtask.errors.InvalidTask"
