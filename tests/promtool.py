"""``promtool check metrics`` (Debian's ``prometheus`` package) on real exposition text."""

from __future__ import annotations

import shutil
import subprocess

from needs import missing


def check_metrics(text: str) -> None:
    """Fail (under CI: the tool is installed by .ci/run) or skip when promtool is missing;
    otherwise assert that promtool finds nothing to say about ``text``."""
    promtool = shutil.which("promtool")
    if promtool is None:
        missing("promtool is not installed (apt-get install prometheus)")
    proc = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0 and not proc.stdout.strip() and not proc.stderr.strip(), (
        proc.stdout + proc.stderr
    )
