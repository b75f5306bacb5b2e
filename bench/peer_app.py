"""The mtask application beside arq's (``bench/arq_app.py``), for bench WQ and WST: the same two
jobs, a counted no-op and a time stamp, and nothing else, so that a start-up measured is mtask's
own and not the bench's helpers' (``mtask-worker bench.peer_app:registry``)."""

from __future__ import annotations

import time
from typing import Any

from bench.finish import LINE
from mtask import Registry

registry = Registry()


@registry.task("noop")
async def noop(params: dict[str, Any]) -> None:
    LINE.started()
    LINE.finished()


@registry.task("stamp")
async def stamp(params: dict[str, Any]) -> float:
    return time.time()  # handler start, on the same host as the bench
