"""Counts as a reader sees them: exact, or a lower bound said as such."""

from __future__ import annotations

from mtask.store.counts import Counts


def test_counts_compare_as_a_dict_and_say_which_are_lower_bounds() -> None:
    counts = Counts({"a": {"pending": 1234, "succeeded": 1001}}, [("a", "succeeded")], 1000)
    assert counts == {"a": {"pending": 1234, "succeeded": 1001}}
    assert counts.is_lower_bound("a", "succeeded") and not counts.is_lower_bound("a", "pending")
    assert counts.show("a", "pending") == "1,234"
    assert counts.show("a", "succeeded") == "1,000+"
    assert counts.show("a", "failed") == "0"
    assert counts.show("b", "failed") == "0"
