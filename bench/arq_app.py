"""The arq worker of bench WQ and WST (``arq bench.arq_app.WorkerSettings``): the same counted
no-op and time-stamp jobs as ``bench.peer_app``, on the Redis whose port ``MTASK_ARQ_PORT``
names."""

from __future__ import annotations

import os
import time
from typing import Any

from arq.connections import RedisSettings

from bench.finish import LINE


async def noop(ctx: dict[str, Any]) -> None:
    LINE.started()
    LINE.finished()


async def stamp(ctx: dict[str, Any]) -> float:
    return time.time()  # job start, on the same host as the publisher


class WorkerSettings:
    functions = [noop, stamp]
    redis_settings = RedisSettings(port=int(os.environ.get("MTASK_ARQ_PORT", "6379")))
    max_jobs = int(os.environ.get("MTASK_ARQ_MAX_JOBS", "64"))
    # arq polls its queue (500 ms by default); 10 ms is what a latency-minded user would set
    poll_delay = float(os.environ.get("MTASK_ARQ_POLL_DELAY", "0.01"))
    keep_result = 3600
