"""Bench WB's pure part: the budget's lines, what counts as growth, and the committed
baseline's shape."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from hypothesis import given
from hypothesis import strategies as st

from bench import budget, features_off
from bench.support import ROOT
from mtask.store.claims import CLAIM_TIMEOUT_S


def test_lines_flatten_each_case() -> None:
    figures = {"drain, as shipped": {"worker µs": 100.0, "index keys": 15.0}}
    assert budget.lines(figures) == {
        "drain, as shipped: worker µs": 100.0,
        "drain, as shipped: index keys": 15.0,
    }


def test_growth_is_named_past_each_kind_of_lines_tolerance() -> None:
    baseline = {
        "a: worker µs": 100.0,
        "a: mongod µs": 100.0,
        "a: index keys": 15.0,
        "a: update ops": 1.0,
        "a: bytes per document": 800.0,
    }
    now = {
        "a: worker µs": 114.0,  # CPU within 15 %: the machine's spread
        "a: mongod µs": 130.0,  # named
        "a: index keys": 16.0,  # a counted line past 5 %: named
        "a: update ops": 1.04,  # under the absolute step
        "a: bytes per document": 700.0,  # smaller: not named
        "b: worker µs": 1e6,  # not in the baseline: nothing to compare
    }
    named = budget.grew(now, baseline)
    assert [line for line, *_ in named] == ["a: mongod µs", "a: index keys"]
    assert named[0][1:3] == (100.0, 130.0)


@given(st.dictionaries(st.sampled_from(["x: worker µs", "x: index keys"]), st.floats(0, 1e6)))
def test_the_baseline_against_itself_never_grew(figures: dict[str, float]) -> None:
    assert budget.grew(figures, figures) == []


def test_the_committed_baseline_has_every_line_the_bench_measures() -> None:
    stored = json.loads(budget.BASELINE.read_text())
    expected = {
        f"{shape}, {variant}: {metric}"
        for shape in budget.SHAPES
        for variant in budget.VARIANTS
        for metric in budget.METRICS
    }
    assert set(stored) == {"quick", "full"}
    for size in stored.values():
        assert set(size) == expected


CHECK_OFF = """
import datetime as dt
from bench import features_off
from mtask import metrics, store
from mtask.worker.running.deadlines import Deadlines

print(sorted(features_off.apply()))
print(next(store.claim(["k"], ["n"], "w", dt.datetime(2026, 1, 1), {"k": 1000})).timeout)
print(type(metrics.by_name(metrics.CLAIMED, "n")).__name__, type(metrics.IN_FLIGHT).__name__)
print(Deadlines.watch.__module__)
"""


def _off(features: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", CHECK_OFF],
        env={**os.environ, features_off.ENV: features},
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )


def test_the_bench_turns_off_only_what_it_is_told_in_its_own_process() -> None:
    """Each WB worker-side variant turns its feature off in the process that asks
    (``MTASK_BENCH_OFF``), and nothing else; an unknown name stops the worker."""
    off = _off("metrics, lease timer, claim timeout")
    assert off.stdout.splitlines() == [
        "['claim timeout', 'lease timer', 'metrics']",
        "None",
        "_Nothing _Nothing",
        "bench.features_off",
    ], off.stderr
    shipped = _off("")
    assert shipped.stdout.splitlines() == [
        "[]",
        str(CLAIM_TIMEOUT_S),
        "Counter Gauge",
        "mtask.worker.running.deadlines",
    ], shipped.stderr
    typo = _off("metric")
    assert typo.returncode != 0
    assert "unknown feature(s) ['metric']" in typo.stderr
