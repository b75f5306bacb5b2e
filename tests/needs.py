"""One reading of ``CI`` for the whole suite: a test that needs a tool the machine
lacks fails under ``CI`` (``.ci/run`` installs every tool, so a missing one is CI's defect) and
is skipped with the reason elsewhere. No test is skipped under ``CI``."""

from __future__ import annotations

import os
from typing import NoReturn

import pytest

IN_CI = os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")
"""``CI`` as GitHub Actions, GitLab and ``.ci/run`` set it (``true``), or ``1``/``yes``."""


def missing(reason: str) -> NoReturn:
    """The test cannot run here because of ``reason`` (what is missing, and how to get it)."""
    if IN_CI:
        pytest.fail(f"{reason} (CI must have it: .ci/run installs it)", pytrace=False)
    pytest.skip(reason)
