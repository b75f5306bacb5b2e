"""Where a claimed document starts its run: one place for every way of claiming (``Starter``).

The claimer's two strategies, the plain batch (``plain.PlainClaims``) and the batch of limited
keys (``limited_claims.LimitedClaims``), hand what they claimed here while its keys still
count as being claimed (``InFlight.claiming``: a claim's own change events must not queue them
before their runs have started): the run side starts each run (``RunStarter``), the finding
side hears of the claim (``QueueSink.claimed``), and the stats count it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from mtask.worker.finding.protocols import QueueSink
from mtask.worker.running.protocols import RunStarter
from mtask.worker.stats import WorkerStats

Held = tuple[tuple[str, ...], frozenset[str]]
"""The limit slots a run holds, and those of them it holds only a token of."""


class Starter:
    """Starts the runs of claimed documents."""

    def __init__(self, runs: RunStarter, sink: QueueSink, stats: WorkerStats) -> None:
        self.runs = runs
        self.sink = sink
        self.stats = stats

    def start(
        self, docs: Sequence[dict[str, Any]], sent: float, held: Mapping[str, Held] | None = None
    ) -> None:
        """Start the runs of ``docs``, in their order (with runs claimed ahead, the first take
        the handler slots): ``sent`` is when (monotonic) their claim was sent, ``held`` what
        each key's run holds of the cluster-wide limits (none if absent)."""
        for doc in docs:
            if held and (slots := held.get(doc["_id"])) is not None:
                self.runs.start(doc, sent, *slots)
            else:  # a run that holds no limit's slot (a plain claim's)
                self.runs.start(doc, sent)
            self.sink.claimed(doc)
        self.stats.claimed += len(docs)
