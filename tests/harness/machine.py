"""What a test needs from the machine beyond Python: each missing thing is ``needs.missing``
(it fails under CI and skips with its reason elsewhere: tests/needs.py reads CI, alone)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from needs import missing


def required(*commands: list[str], hint: str = "") -> None:
    """Each command runs and exits 0, or the test is ``missing`` it (``hint``: where to get
    them)."""
    for command in commands:
        ok = shutil.which(command[0]) is not None
        if ok:
            ok = subprocess.run(command, capture_output=True, check=False).returncode == 0
        if not ok:
            missing(f"needs {' '.join(command)}" + (f" ({hint})" if hint else ""))


def need_proc() -> None:
    """The test reads /proc and sends POSIX signals (Linux)."""
    if not (sys.platform.startswith("linux") and os.path.isdir("/proc/self")):
        missing("needs Linux's /proc and POSIX signals")


def node(driver_in: Path | None = None) -> str:
    """The ``node`` binary (Debian's nodejs; ``.ci/run`` installs it); with ``driver_in``, the
    official ``mongodb`` driver installed there too (``npm ci --prefix driver_in``)."""
    found = shutil.which("node")
    if found is None:
        missing("Node.js is not installed (Debian: apt-get install nodejs npm)")
    if driver_in is not None and not (driver_in / "node_modules" / "mongodb").is_dir():
        missing(f"the mongodb npm driver is missing: run npm ci --prefix {driver_in}")
    return found
