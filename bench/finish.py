"""A worker process's own finish line (bench WQ): its no-op handler counts the jobs it ran, and
the process writes one file when the n-th has finished. During a drain the harness watches that
file, and reads neither queue's broker (``bench/peers.py``).

The same code in mtask's worker (``bench.peer_app``) and arq's (``bench.arq_app``): the handler
calls ``started()`` and ``finished()``; ``MTASK_BENCH_FINISH`` names the file and
``MTASK_BENCH_N`` the count (unset: nothing is counted). The line holds the first job's start
and the n-th one's end (``time.time()``) and the CPU the process used between them."""

from __future__ import annotations

import json
import os
import time

FILE = "MTASK_BENCH_FINISH"
COUNT = "MTASK_BENCH_N"


class FinishLine:
    def __init__(self) -> None:
        self.path = os.environ.get(FILE)
        self.n = int(os.environ.get(COUNT, "0"))
        self.count = 0
        self.first: float | None = None
        self.cpu_first = 0.0

    def started(self) -> None:
        if self.first is None:
            self.first = time.time()
            self.cpu_first = time.process_time()

    def finished(self) -> None:
        self.count += 1
        if self.count == self.n and self.path:
            line = {
                "first": self.first,
                "last": time.time(),
                "cpu": time.process_time() - self.cpu_first,  # the process's, every thread's
                "n": self.n,
            }
            with open(f"{self.path}.tmp", "w") as out:
                json.dump(line, out)
            os.replace(f"{self.path}.tmp", self.path)  # the harness sees all of it or nothing


LINE = FinishLine()
