"""Claiming ahead (``mtask.worker.claiming.ahead``): when the adaptive policy claims ahead, and how
a run claimed ahead waits for its slot or is given back."""

from __future__ import annotations

import argparse
import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mtask.worker.claiming import ahead as claim_ahead
from mtask.worker.claiming.ahead import AdaptiveAhead, FixedAhead
from mtask.worker.running.handler_slots import GiveBack, RunSlots


def test_runs_are_taken_to_be_short_until_a_run_and_a_claim_were_measured() -> None:
    ahead = AdaptiveAhead(8)
    assert ahead.allowed() == 8
    ahead.ran(0.050)
    assert ahead.allowed() == 8  # no round trip to compare with yet
    ahead.claimed(0.005)
    assert ahead.allowed() == 0


def test_runs_longer_than_a_round_trip_are_not_claimed_ahead() -> None:
    ahead = AdaptiveAhead(8)
    ahead.claimed(0.005)
    ahead.ran(0.050)
    assert ahead.allowed() == 0


def test_it_turns_on_below_half_a_round_trip_and_off_above_one() -> None:
    ahead = AdaptiveAhead(4)
    ahead.claimed(0.010)
    ahead.ran(0.020)
    assert ahead.allowed() == 0
    for _ in range(100):
        ahead.ran(0.007)  # shorter than a round trip, but not than half of one: still off
        assert ahead.allowed() == 0
    while ahead.allowed() == 0:
        ahead.ran(0.001)
    assert ahead.run_s is not None and ahead.run_s < 0.005
    while ahead.run_s < 0.009:  # between half a round trip and one: stays on
        ahead.ran(0.012)
        if ahead.run_s < 0.010:
            assert ahead.allowed() == 4
    while ahead.allowed() == 4:
        ahead.ran(0.012)
    assert ahead.run_s > 0.010


def test_nothing_is_claimed_ahead_while_a_cluster_wide_limit_is_set() -> None:
    limits: list[str] = []
    ahead = AdaptiveAhead(8, limited=lambda: bool(limits))
    assert ahead.allowed() == 8
    limits.append("work")  # a run claimed ahead would hold its slot of the limit
    assert ahead.allowed() == 0
    limits.clear()
    assert ahead.allowed() == 8


def test_a_run_given_back_stops_claiming_ahead_until_runs_are_short_again() -> None:
    ahead = AdaptiveAhead(8, give_back_after=1.0)
    ahead.claimed(0.005)
    ahead.ran(0.0001)
    assert ahead.allowed() == 8
    ahead.gave_back()
    assert ahead.allowed() == 0 and ahead.given_back == 1
    short_runs = 0
    while ahead.allowed() == 0:
        ahead.ran(0.0001)
        short_runs += 1
    assert short_runs > 50  # counted as a run of a second: many short ones before it is on


@given(
    st.lists(
        st.tuples(st.sampled_from(["ran", "claimed", "gave_back"]), st.floats(0, 100)),
        max_size=60,
    ),
    st.integers(1, 500),
)
def test_adaptive_ahead_is_none_or_the_concurrency(
    calls: list[tuple[str, float]], concurrency: int
) -> None:
    ahead = AdaptiveAhead(concurrency)
    for call, seconds in calls:
        if call == "gave_back":
            ahead.gave_back()
        else:
            getattr(ahead, call)(seconds)
        assert ahead.allowed() in (0, concurrency)
        if ahead.allowed() and ahead.run_s is not None and ahead.round_trip_s is not None:
            assert ahead.run_s < ahead.round_trip_s
        if call == "gave_back":
            assert ahead.allowed() == 0


def test_build_chooses_by_prefetch() -> None:
    auto, auto_slots = claim_ahead.build(4, "auto", limited=lambda: False)
    assert isinstance(auto, AdaptiveAhead) and isinstance(auto_slots, RunSlots)
    assert auto_slots.give_back_after == claim_ahead.GIVE_BACK_AFTER
    fixed, fixed_slots = claim_ahead.build(4, 3, limited=lambda: True)
    assert isinstance(fixed, FixedAhead) and fixed.allowed() == 3
    assert isinstance(fixed_slots, RunSlots) and fixed_slots.give_back_after is None
    never, no_slots = claim_ahead.build(4, 0, limited=lambda: False)
    assert isinstance(never, FixedAhead) and never.allowed() == 0 and no_slots is None


async def test_a_run_claimed_ahead_takes_the_slot_that_frees() -> None:
    slots = RunSlots(1, give_back_after=30.0)
    order: list[str] = []
    release = asyncio.Event()

    async def run(name: str) -> None:
        async with slots:
            order.append(name)
            if name == "first":
                await release.wait()

    first = asyncio.create_task(run("first"))
    await asyncio.sleep(0)
    second = asyncio.create_task(run("second"))
    await asyncio.sleep(0)
    assert order == ["first"]
    release.set()
    await asyncio.gather(first, second)
    assert order == ["first", "second"]


async def test_a_run_that_waits_past_the_bound_is_given_back() -> None:
    given_back: list[bool] = []
    slots = RunSlots(1, give_back_after=0.05, on_give_back=lambda: given_back.append(True))
    held = asyncio.Event()
    done = asyncio.Event()

    async def holder() -> None:
        async with slots:
            held.set()
            await done.wait()

    task = asyncio.create_task(holder())
    await held.wait()
    with pytest.raises(GiveBack):
        async with slots:
            raise AssertionError("it never had the slot")
    assert given_back == [True]
    done.set()
    await task
    async with slots:  # the slot given back by the holder is free; no waiter was left behind
        pass


async def test_without_a_bound_a_run_waits_as_long_as_it_takes() -> None:
    slots = RunSlots(1)
    async with slots:
        waiter = asyncio.create_task(slots.__aenter__())
        for _ in range(10):  # turns of the loop: no timer gives it back
            await asyncio.sleep(0)
        assert not waiter.done()
    await waiter
    await slots.__aexit__(None, None, None)


def test_the_prefetch_option_takes_auto_or_a_number(capsys: pytest.CaptureFixture[str]) -> None:
    from mtask.cli.worker import add_worker_options

    parser = argparse.ArgumentParser(prog="mtask-worker")
    add_worker_options(parser)
    assert parser.parse_args(["app:registry"]).prefetch == "auto"
    assert parser.parse_args(["app:registry", "--prefetch", "auto"]).prefetch == "auto"
    assert parser.parse_args(["app:registry", "--prefetch", "3"]).prefetch == 3
    for bad in ("-1", "many"):
        with pytest.raises(SystemExit) as exited:
            parser.parse_args(["app:registry", "--prefetch", bad])
        assert exited.value.code == 2
        err = capsys.readouterr().err
        assert "--prefetch" in err and f"expected auto or a number not below 0, got {bad!r}" in err


@pytest.mark.parametrize("bad", [-1, "always", True, 1.5])
def test_a_worker_refuses_a_bad_prefetch(bad: object) -> None:
    from mtask.errors import ConfigError
    from mtask.registry import Registry
    from mtask.worker.config import WorkerConfig

    registry = Registry()

    @registry.task("t")
    async def t(params: dict[str, object]) -> None:
        return None

    with pytest.raises(ConfigError) as caught:
        WorkerConfig(prefetch=bad).chosen_names(registry)  # type: ignore[arg-type]
    assert caught.value.field == "prefetch"
