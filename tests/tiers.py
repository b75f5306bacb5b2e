"""Each tier's share of a pytest run (issue 60): the tests of ``tests/unit``, ``integration``,
``acceptance`` and ``chaos`` counted and their setup, call and teardown times summed, so that
the one ``pytest`` of ``.ci/run`` says what each tier costs. Pure: ``tests/conftest.py`` feeds
it pytest's reports and prints its lines."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import PurePosixPath

ORDER = ("unit", "integration", "acceptance", "chaos")


@dataclass
class Tier:
    tests: int = 0
    seconds: float = 0.0


def tier_of(nodeid: str) -> str:
    """The folder below ``tests/`` a test's file is in (``other`` for a file of ``tests/``
    itself, or one outside it)."""
    parts = PurePosixPath(nodeid.split("::", 1)[0]).parts
    if "tests" in parts:
        below = parts[parts.index("tests") + 1 :]
        if len(below) > 1:
            return below[0]
    return "other"


def tier_times(phases: Iterable[tuple[str, float]]) -> dict[str, Tier]:
    """Each tier's tests (distinct node ids) and the sum of their phases' seconds, from
    ``(nodeid, seconds)``: one a phase (setup, call, teardown) of a test; the tiers in
    ``ORDER``, any other after them by name."""
    tiers: dict[str, Tier] = {}
    seen: set[str] = set()
    for nodeid, seconds in phases:
        tier = tiers.setdefault(tier_of(nodeid), Tier())
        tier.seconds += seconds
        if nodeid not in seen:
            seen.add(nodeid)
            tier.tests += 1
    rank = {name: i for i, name in enumerate(ORDER)}
    return dict(sorted(tiers.items(), key=lambda kv: (rank.get(kv[0], len(ORDER)), kv[0])))


def tier_lines(tiers: dict[str, Tier]) -> list[str]:
    return [f"tier {name}: {t.tests} tests, {t.seconds:.1f} s" for name, t in tiers.items()]


SERIAL = ("chaos",)
"""Tiers whose tests run one at a time, in one test process: each loads the machine on its own
(replica sets, killed and frozen workers) and measures how the system holds under it."""


def group_of(nodeid: str) -> str:
    """The ``xdist_group`` of a test (``--dist loadgroup``): a serial tier's name, else its
    file, so that a file's tests share one process and its module fixtures."""
    tier = tier_of(nodeid)
    return tier if tier in SERIAL else nodeid.split("::", 1)[0]
