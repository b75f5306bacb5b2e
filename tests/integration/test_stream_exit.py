"""An abandoned ``client.stream`` iterator closes quietly at interpreter exit: its
change stream is left for the server to drop with the connection, instead of pymongo failing
to import what killing a cursor needs ("Exception ignored … Python is likely shutting down")."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from typing import Any

from harness import running_worker

from mtask import AsyncTaskClient
from mtask.registry import Registry, TaskContext

registry = Registry()
SAID = asyncio.Event()


@registry.task("talk_then_wait")
async def talk_then_wait(params: dict[str, Any], ctx: TaskContext) -> None:
    ctx.log.info("hello")
    SAID.set()
    await asyncio.sleep(0.5)  # the reader's stream is open, waiting for the next line
    ctx.log.info("again")
    await asyncio.sleep(3600)  # open while the reader leaves


READER = """
import sys
from mtask import TaskClient
client = TaskClient(sys.argv[1], database=sys.argv[2])
entries = client.stream("k")
print(next(entries).message, next(entries).message, flush=True)
# the iterator is left open, its change stream too: the interpreter exits with both
"""


async def test_an_abandoned_stream_closes_quietly_at_exit(
    aclient: AsyncTaskClient, mongo_uri: str, db_name: str
) -> None:
    SAID.clear()
    async with running_worker(registry, mongo_uri, db_name):
        await aclient.publish("talk_then_wait", "k", {})
        await asyncio.wait_for(SAID.wait(), 20)
        done = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-c", READER, mongo_uri, db_name],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "hello again"
    assert done.stderr == ""
