"""``python -m bench [--quick] [--only W0,W1] [--output FILE]``: run the workloads and write the
results table (``bench/results.md`` by default)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from rich.console import Console

from bench import scale
from bench.batches import batch_handlers
from bench.budget import cost_budget
from bench.children import children_cost
from bench.cpu import w10_cpu
from bench.groups import groups_cost
from bench.limits import limit_changes
from bench.output import live_output
from bench.peers import peers
from bench.preflight import preflight_at_scale
from bench.relay import relay_faults
from bench.startup import startup
from bench.steps import durable_steps
from bench.support import FULL, QUICK, floor_helper
from bench.triggers import reacting
from bench.validator import validator_ab, validator_interleaved
from bench.workloads import Bench
from mtask.connection.clients import resolve_uri

DESCRIPTION = "mtask's benchmark suite: throughput and latency on a real server."

WORKLOADS = {
    "W0": Bench.w0_baseline,
    "W1": Bench.w1_drain,
    "W1T": Bench.w1_txn,
    "W2": Bench.w2_latency,
    "W3": Bench.w3_takeover,
    "W4": Bench.w4_scale,
    "W5": Bench.w5_stampede,
    "W6": Bench.w6_publish,
    "W8": Bench.w8_delayed,
    # (bench/scale.py): stats at scale, many workers, memory under a backlog
    "ST": scale.stats_at_scale,
    "W9": scale.many_workers,
    "W9H": scale.many_hosts,  # one worker per host (network namespaces)
    "W7X": scale.backlog_memory,
    "WR": relay_faults,  # the relay's holder or a subscriber killed, frozen, cut off
    "W10": w10_cpu,  # CPU-bound: thread vs process pool (bench/cpu.py)
    "WV": validator_ab,  # the $jsonSchema validator's cost on W1 and W6, A/B (bench/validator.py)
    "WVI": validator_interleaved,  # the same, interleaved batch by batch / side by side
    "WO": live_output,  # what progress, log lines and chunks cost (bench/output.py)
    "WS": durable_steps,  # what a step, a sleep and a signal wait cost (bench/steps.py)
    "WB": cost_budget,  # the cost budget per task, beside bench/budget.json
    "WQ": peers,  # W1 and W2 beside arq on Redis, same run (bench/peers.py)
    "WBH": batch_handlers,  # batch handlers against single-task ones, one run
    "WG": groups_cost,  # fairness, group limits and sequences in a drain
    "WL": limit_changes,  # a lowered limit applies on its event (bench/limits.py)
    "WST": startup,  # a worker's first claim, the CLI's answer, beside arq's start-up
    "WT": reacting,  # triggers and waits on data (bench/triggers.py)
    "WC": children_cost,  # a spawned-and-awaited child's cost (bench/children.py)
    "WF": preflight_at_scale,  # 100,000 parked tasks preflighted (bench/preflight.py)
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=DESCRIPTION)
    parser.add_argument("--uri", help="MongoDB URI (default: $MTASK_MONGODB_URI, else embedded)")
    parser.add_argument("--quick", action="store_true", help="small sizes, for CI")
    parser.add_argument("--only", help="comma-separated workloads, e.g. W0,W1")
    parser.add_argument("--output", default="bench/results.md")
    parser.add_argument(
        "--validator", action="store_true", help="tasks collections with the $jsonSchema validator"
    )
    parser.add_argument("--floor-helper", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.floor_helper:
        return floor_helper(*args.floor_helper)
    console = Console(highlight=False)
    bench = Bench(resolve_uri(args.uri), QUICK if args.quick else FULL, console)
    bench.validator = args.validator
    chosen = args.only.split(",") if args.only else list(WORKLOADS)
    if "W1" in chosen and "W0" not in chosen:
        chosen.insert(0, "W0")
    took: dict[str, float] = {}
    for key in chosen:
        started = time.monotonic()
        WORKLOADS[key](bench)
        took[key] = time.monotonic() - started
    bench.report(Path(args.output), args.quick)
    console.print("took: " + ", ".join(f"{k} {s:.0f} s" for k, s in took.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
