"""The per-tier times of a pytest run (tests/tiers.py): each tier's tests counted once and
their phases' seconds summed."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from tiers import Tier, tier_lines, tier_of, tier_times


@pytest.mark.parametrize(
    ("nodeid", "tier"),
    [
        ("tests/unit/test_clock.py::test_a", "unit"),
        ("tests/integration/test_bulk.py::test_b[x-1]", "integration"),
        ("tests/chaos/test_kills.py::test_c", "chaos"),
        ("tests/acceptance/test_readme.py::test_d[a/b::c]", "acceptance"),
        ("tests/test_top.py::test_e", "other"),
        ("elsewhere/test_f.py::test_f", "other"),
    ],
)
def test_a_tests_tier_is_the_folder_below_tests(nodeid: str, tier: str) -> None:
    assert tier_of(nodeid) == tier


def test_each_test_counts_once_and_its_setup_call_and_teardown_add_up() -> None:
    phases = [
        ("tests/chaos/test_kills.py::test_k", 1.0),
        ("tests/unit/test_a.py::test_1", 0.25),
        ("tests/unit/test_a.py::test_1", 0.5),
        ("tests/unit/test_a.py::test_1", 0.25),
        ("tests/unit/test_b.py::test_2", 2.0),
        ("tests/integration/test_c.py::test_3", 3.0),
        ("tests/integration/test_c.py::test_3", 0.5),
        ("tests/weird/test_w.py::test_w", 0.1),
    ]
    tiers = tier_times(phases)
    assert list(tiers) == ["unit", "integration", "chaos", "weird"]
    assert tiers["unit"] == Tier(tests=2, seconds=3.0)
    assert tiers["integration"] == Tier(tests=1, seconds=3.5)
    assert tiers["chaos"] == Tier(tests=1, seconds=1.0)
    assert tier_lines(tiers) == [
        "tier unit: 2 tests, 3.0 s",
        "tier integration: 1 tests, 3.5 s",
        "tier chaos: 1 tests, 1.0 s",
        "tier weird: 1 tests, 0.1 s",
    ]


def test_no_phases_no_tiers() -> None:
    assert tier_times([]) == {} and tier_lines({}) == []


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["unit", "integration", "acceptance", "chaos"]),
            st.integers(0, 5),
            st.floats(0, 100, allow_nan=False),
        )
    )
)
def test_the_tiers_add_up_to_the_whole_run(rows: list[tuple[str, int, float]]) -> None:
    phases = [(f"tests/{tier}/test_m.py::test_{n}", s) for tier, n, s in rows]
    tiers = tier_times(phases)
    assert sum(t.tests for t in tiers.values()) == len({nodeid for nodeid, _ in phases})
    assert sum(t.seconds for t in tiers.values()) == pytest.approx(sum(s for _, s in phases))


def test_a_file_is_a_group_and_the_chaos_tier_takes_two_lanes() -> None:
    from tiers import LANES, group_of

    assert group_of("tests/integration/test_x.py::test_a[1]") == "tests/integration/test_x.py"
    assert group_of("tests/integration/test_x.py::test_b") == "tests/integration/test_x.py"
    a, b = group_of("tests/chaos/test_kills.py::test_a"), group_of("tests/chaos/test_kills.py::b")
    assert a == b and a in {f"chaos-{n}" for n in range(LANES)}  # a file's tests in one lane
    lanes = {group_of(f"tests/chaos/test_{n}.py::test_a") for n in range(40)}
    assert lanes == {f"chaos-{n}" for n in range(LANES)}
