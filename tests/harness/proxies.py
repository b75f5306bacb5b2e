"""Faults between a worker and MongoDB: a ``socat`` proxy per host, to cut off or freeze."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path


class Proxies:
    """A ``socat`` per host, from a socket of its own to mongod's, in a process group of its
    own so that a freeze reaches the connections it forked too."""

    def __init__(self, mongod_socket: str, root: Path) -> None:
        self.mongod_socket = mongod_socket
        self.root = root
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, host: str) -> str:
        path = self.root / f"{host}.sock"
        self.procs[host] = subprocess.Popen(
            ["socat", f"UNIX-LISTEN:{path},fork,unlink-early",
             f"UNIX-CONNECT:{self.mongod_socket}"],
            stderr=subprocess.DEVNULL,  # "Broken pipe" as connections end
            start_new_session=True,
        )  # fmt: skip
        deadline = time.monotonic() + 10
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        return f"mongodb://{str(path).replace('/', '%2F')}/?directConnection=true"

    def signal(self, host: str, sig: signal.Signals) -> None:
        os.killpg(self.procs[host].pid, sig)

    def close(self) -> None:
        for proc in self.procs.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGCONT)
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
