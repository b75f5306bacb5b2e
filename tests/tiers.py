"""Each tier's share of a pytest run: the tests of ``tests/unit``, ``integration``,
``acceptance`` and ``chaos`` counted and their setup, call and teardown times summed, so that
the one ``pytest`` of ``.ci/run`` says what each tier costs. Pure: ``tests/conftest.py`` feeds
it pytest's reports and prints its lines."""

from __future__ import annotations

import zlib
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
"""Tiers whose tests run in few lanes, one test at a time in each: each loads the machine on
its own (replica sets, killed and frozen workers) and measures how the system holds under it."""

LANES = 2
"""How many lanes a serial tier takes: two of its tests at once at most (three at once failed
four of them on load alone, on this 2-core machine)."""


def group_of(nodeid: str) -> str:
    """The scope of a test for the suite's scheduler (``tests/conftest.py``): a serial tier's
    lane (by its file, so a file's tests share one process and its module fixtures), else its
    file."""
    tier = tier_of(nodeid)
    path = nodeid.split("::", 1)[0]
    if tier not in SERIAL:
        return path
    lane = zlib.crc32(PurePosixPath(path).name.encode()) % LANES
    return f"{tier}-{lane}"
