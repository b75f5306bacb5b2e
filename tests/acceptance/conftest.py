from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "docker: needs a Docker engine and the base images (../shared/docker/standin-images.sh)",
    )
