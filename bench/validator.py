"""Bench WV: what the ``$jsonSchema`` validator (``mtask collection init --validator``) costs on
W1 (drain) and W6 (publish), as an A/B in one run: each round measures both workloads on a
fresh database with and on one without the validator, the order alternating every round, and
the figure is the median of the per-round ratios (validator / none). On a shared machine the
load moves every absolute figure; a ratio within one round is what can be compared.
"""

from __future__ import annotations

import os
import statistics
from typing import TYPE_CHECKING

from bench.support import Result

if TYPE_CHECKING:
    from bench.workloads import Bench

ROUNDS = int(os.environ.get("MTASK_BENCH_VALIDATOR_ROUNDS", "6"))


def one(bench: Bench, validator: bool) -> dict[str, float]:
    bench.validator = validator
    try:
        drain, _ = bench.drain("noop")
        single, many = bench.publish_rates()
    finally:
        bench.validator = False
    return {"drain": drain, "single": single, "many": many}


def validator_ab(bench: Bench) -> None:
    ratios: dict[str, list[float]] = {"drain": [], "single": [], "many": []}
    for r in range(ROUNDS):
        order = (False, True) if r % 2 == 0 else (True, False)
        figures = {flag: one(bench, flag) for flag in order}
        load = os.getloadavg()[0]
        for kind in ratios:
            ratios[kind].append(figures[True][kind] / figures[False][kind])
        bench.console.print(
            f"round {r + 1} (validator {'second' if r % 2 == 0 else 'first'}, load {load:.1f}): "
            + ", ".join(
                f"{kind} {figures[False][kind]:,.0f} → {figures[True][kind]:,.0f}/s"
                for kind in ratios
            )
        )
    median = {kind: statistics.median(values) for kind, values in ratios.items()}
    spread = {kind: (min(values), max(values)) for kind, values in ratios.items()}
    figure = ", ".join(
        f"{kind} x{median[kind]:.2f} ({spread[kind][0]:.2f}-{spread[kind][1]:.2f})"
        for kind in ratios
    )
    bench.record(
        Result(
            "WV validator cost",
            figure,
            "(no target)",
            None,
            f"{ROUNDS} rounds, order alternating; W1 drain of {bench.sizes.drain:,} no-op tasks "
            f"(one worker, concurrency 64) and W6 publish ({bench.sizes.publish // 4:,} singles, "
            f"32 at once) / publish_many ({bench.sizes.publish:,}); median ratio validator / "
            "none (min-max)",
            {f"{kind}_ratio": value for kind, value in median.items()},
        )
    )
