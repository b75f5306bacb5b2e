"""A step's admission by the windows of tokens of the resources its run takes
(``RunUsage.admitted``): what the store's answers make it do: start, wait in place for a window
that ends soon, or snooze its run until a window that ends later."""

from __future__ import annotations

import pytest

from mtask import Snooze
from mtask.usage import charges
from mtask.usage.charges import MemoryUsage, RunUsage


class Windows(MemoryUsage):
    """A store whose admissions answer, in turn, ``answers`` (``None``: admitted)."""

    def __init__(self, *answers: float | None) -> None:
        super().__init__()
        self.answers = list(answers)
        self.asked = 0

    async def admit(self) -> tuple[float, str] | None:
        self.asked += 1
        wait = self.answers.pop(0)
        return None if wait is None else (wait, "resource `llm`: 120 of 100 tokens charged")


async def test_a_step_admitted_at_once_starts() -> None:
    store = Windows(None)
    await RunUsage(store).check()
    assert store.asked == 1


async def test_a_window_that_ends_soon_is_waited_for_in_place_then_asked_again() -> None:
    store = Windows(0.01, 0.02, None)
    await RunUsage(store).check()
    assert store.asked == 3 and store.answers == []


async def test_a_window_that_ends_later_snoozes_the_run_until_its_end() -> None:
    store = Windows(charges.IN_PLACE_S + 5)
    with pytest.raises(Snooze) as snoozed:
        await RunUsage(store).check()
    assert snoozed.value.seconds == pytest.approx(charges.IN_PLACE_S + 5)
    assert store.asked == 1 and "resource `llm`: 120 of 100" in snoozed.value.reason


async def test_refusals_after_each_wait_in_place_snooze_the_run_in_the_end() -> None:
    store = Windows(*[0.001] * (charges.IN_PLACE_TRIES + 1))
    with pytest.raises(Snooze):
        await RunUsage(store).check()
    assert store.asked == charges.IN_PLACE_TRIES + 1
