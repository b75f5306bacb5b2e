"""Hypothesis against a real server: each example is slow and uses the test's fixtures."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hypothesis import HealthCheck, Phase, settings


def on_a_server(max_examples: int) -> Callable[[Any], Any]:
    """``@settings`` for a property test whose examples run against MongoDB (and workers):
    no deadline, slow examples and function-scoped fixtures allowed, and no shrinking (it
    would run many more examples on the server)."""
    return settings(
        max_examples=max_examples,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
        phases=[Phase.explicit, Phase.reuse, Phase.generate],
    )
