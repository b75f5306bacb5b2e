"""The chaos suite's invariants, checked from the task documents and the execution log.

- I1 nothing lost: every task ends succeeded, failed (with its error) or cancelled.
- I2 bounded concurrency: at no instant do more runs of a task overlap than its concurrency.
  A run lasts from its ``start`` entry to its end entry; a run that was killed (no end entry)
  or stopped after losing its lease lasts until its lease ran out, since the worker stops a
  run whose lease ran out by its own clock before any other worker can take it; a cancelled
  plain-def handler that never returns (its thread abandoned) until it was recorded CANCELLED.
- I3 fencing: every SUCCESS or FAIL in a task document comes from a run that logged that end,
  and no run that was stopped (``cancelled`` entry) or lost its lease has an outcome.
- I4 retry budget: failed runs (FAIL and TIMEOUT) never exceed ``max_retries`` plus the runs
  that were already under way when the last one failed (concurrency - 1), and a task never has
  more runs than ``concurrency + max_retries + concurrency - 1 + releases``.
"""

from __future__ import annotations

import datetime as dt
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

FINISHED = {"succeeded", "failed", "cancelled"}


@dataclass
class Report:
    tasks: int = 0
    runs: int = 0
    timeouts: int = 0
    unrecorded_ends: int = 0
    """Runs that logged their end but lost the task before the outcome was written (killed
    just after, or frozen): their outcome was refused."""
    by_status: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    problems: list[str] = field(default_factory=list)

    def fail(self, text: str) -> None:
        if len(self.problems) < 50:
            self.problems.append(text)


def check(db: Any, keys: set[str] | None = None) -> Report:
    report = Report()
    log: dict[str, dict[str, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for entry in db["execlog"].find({}, sort=[("at", 1), ("_id", 1)]):
        log[entry["key"]][entry["run_id"]].append(entry)
    docs = list(db["tasks"].find({} if keys is None else {"_id": {"$in": sorted(keys)}}))
    if keys is not None and len(docs) != len(keys):
        missing = keys - {d["_id"] for d in docs}
        report.fail(f"I1: {len(missing)} published task(s) have no document: {sorted(missing)[:5]}")
    for doc in docs:
        report.tasks += 1
        report.by_status[doc["status"]] += 1
        _check_task(doc, log.get(doc["_id"], {}), report)
    return report


def _check_task(doc: dict[str, Any], runs_log: dict[str, list[dict[str, Any]]], r: Report) -> None:
    key, status = doc["_id"], doc["status"]
    # I1
    if status not in FINISHED:
        r.fail(f"I1: {key} is {status}")
    if status == "failed" and not doc.get("error"):
        r.fail(f"I1: {key} failed without a reason")
    if doc.get("runs_folded"):
        r.fail(f"{key}: runs were folded; the checks need every run")
    runs = {run["run_id"]: run for run in doc["runs"]}
    r.runs += len(runs)
    states: dict[str, int] = defaultdict(int)
    for run in runs.values():
        states[run["state"]] += 1
    r.timeouts += states["TIMEOUT"]
    _check_fencing(doc, runs, runs_log, states, r)
    _check_budget(doc, runs, states, r)
    concurrency = doc["options"]["concurrency"]
    overlap = _max_overlap(runs, runs_log, key, r)
    if overlap > concurrency:
        r.fail(f"I2: {overlap} runs of {key} overlapped; concurrency {concurrency}")


def _check_fencing(
    doc: dict[str, Any],
    runs: dict[str, dict[str, Any]],
    runs_log: dict[str, list[dict[str, Any]]],
    states: dict[str, int],
    r: Report,
) -> None:
    """I3: outcomes only from runs that logged that very end."""
    key = doc["_id"]
    wanted = {"SUCCESS": ["finish"], "FAIL": ["fail"]}
    for run_id, run in runs.items():
        ends = [e["event"] for e in runs_log.get(run_id, []) if e["event"] != "start"]
        if run["state"] in wanted and ends != wanted[run["state"]]:
            r.fail(f"I3: {key} run {run_id} is {run['state']} but logged {ends}")
        if run["state"] == "TIMEOUT" and ends and ends != ["cancelled"]:
            r.unrecorded_ends += 1  # it ended after its lease; its outcome was refused
    for run_id in runs_log:
        if run_id not in runs:
            r.fail(f"I3: {key} has a logged run {run_id} the document does not know")
    if states["SUCCESS"] != doc["successes"]:
        r.fail(f"I3: {key} successes={doc['successes']} but {states['SUCCESS']} SUCCESS runs")


def _check_budget(
    doc: dict[str, Any], runs: dict[str, dict[str, Any]], states: dict[str, int], r: Report
) -> None:
    """I4: failures within max_retries (plus runs under way when the last failed)."""
    key, options = doc["_id"], doc["options"]
    concurrency, max_retries = options["concurrency"], options["max_retries"]
    failed_runs = states["FAIL"] + states["TIMEOUT"]
    if failed_runs > max_retries + concurrency:
        r.fail(f"I4: {key} has {failed_runs} failed runs with max_retries={max_retries}")
    budget = 2 * concurrency - 1 + max_retries + states["RELEASED"] + states["CANCELLED"]
    if len(runs) > budget:
        r.fail(f"I4: {key} ran {len(runs)} times; the budget is {budget}")
    if states["SUCCESS"] > concurrency:
        r.fail(f"I4: {key} succeeded {states['SUCCESS']} times, concurrency {concurrency}")


def _max_overlap(
    runs: dict[str, dict[str, Any]],
    runs_log: dict[str, list[dict[str, Any]]],
    key: str,
    r: Report,
) -> int:
    edges: list[tuple[dt.datetime, int]] = []
    for run_id, entries in runs_log.items():
        starts = [e["at"] for e in entries if e["event"] == "start"]
        ends = [e for e in entries if e["event"] != "start"]
        if len(starts) != 1 or len(ends) > 1:
            r.fail(f"I2: {key} run {run_id} logged {[e['event'] for e in entries]}")
            continue
        run = runs.get(run_id, {})
        lease_end = run.get("lease_expires_at")
        if ends and ends[0]["event"] != "cancelled":
            end = ends[0]["at"]
        elif run.get("state") in ("TIMEOUT",) and lease_end is not None:
            # killed, or stopped when its lease ran out: it ran no longer than its lease
            end = min(ends[0]["at"], lease_end) if ends else lease_end
        elif ends:
            end = ends[0]["at"]
        elif run.get("state") == "CANCELLED" and run.get("finished_at") is not None:
            # a plain-def handler Python cannot stop: its thread was abandoned when the run
            # was recorded CANCELLED; the task never runs again unless retried
            end = run["finished_at"]
        else:
            r.fail(f"I2: {key} run {run_id} ({run.get('state')}) never ended")
            continue
        edges += [(starts[0], 1), (end, -1)]
    edges.sort(key=lambda e: (e[0], e[1]))  # at equal times, ends first
    now = peak = 0
    for _, delta in edges:
        now += delta
        peak = max(peak, now)
    return peak
