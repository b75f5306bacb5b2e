"""The children's reaper: a small process that kills every child's process group when the worker
dies, even by SIGKILL (docs/isolation.md, "Children bounded and contained"), and ``killpg``.

Each child leads a process group of its own, which every process its handler starts inherits.
The pool tells the reaper each group as its child starts (``+PGID``) and ends (``-PGID``) on the
reaper's stdin; only the worker holds the write end, so when the worker is gone, however it went,
the reaper reads EOF and SIGKILLs every group still listed. It holds nothing else."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading

REAPER_CODE = """
import os, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)
groups = set()
for line in sys.stdin.buffer:
    pid = int(line[1:])
    if line[:1] == b"+":
        groups.add(pid)
    else:
        groups.discard(pid)
for pid in groups:
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass
"""
"""The reaper: reads ``+PGID``/``-PGID`` lines; at EOF (the pool closed, or the worker died,
even by SIGKILL: only the worker holds the write end) SIGKILLs every group still listed."""


class Reaper:
    """The pool's reaper process (``REAPER_CODE``): started with the first child, in a session
    of its own (signals for the worker's process group do not reach it), outliving the worker
    by the moment it takes to kill the children's groups."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._process: subprocess.Popen[bytes] | None = None

    def _send(self, line: str) -> None:
        with self._lock:
            if self._process is None:
                self._process = subprocess.Popen(
                    [sys.executable, "-I", "-S", "-c", REAPER_CODE],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.DEVNULL,
                    start_new_session=True,
                )
            stdin = self._process.stdin
            assert stdin is not None
            with contextlib.suppress(OSError, ValueError):
                stdin.write(line.encode() + b"\n")
                stdin.flush()

    def add(self, pgid: int) -> None:
        self._send(f"+{pgid}")

    def remove(self, pgid: int) -> None:
        if self._process is not None:
            self._send(f"-{pgid}")

    def close(self) -> None:
        with self._lock:
            process, self._process = self._process, None
        if process is not None:
            with contextlib.suppress(OSError, ValueError):
                assert process.stdin is not None
                process.stdin.close()
            try:
                process.wait(5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def killpg(pgid: int | None, sig: int = signal.SIGKILL) -> None:
    """Signal a child's process group (the child and what its handler started), if it is
    still there."""
    if pgid is not None:
        with contextlib.suppress(OSError):
            os.killpg(pgid, sig)
