"""The chaos harness's ``Cluster`` fails the test whose worker crashed: a worker process that
exits with an error on its own is named with the end of its log when the cluster closes, unless
the test said it would (``expect_exit``); one that stops cleanly passes."""

from __future__ import annotations

from pathlib import Path

import pytest
from harness import Cluster
from harness.processes import TESTS


def crashing(uri: str, db_name: str, logs: Path) -> Cluster:
    """A cluster whose worker ``w-bad`` names a registry that does not exist: it exits 2."""
    cluster = Cluster(uri, db_name, logs, app="workerapp:no_such_registry", home=TESTS)
    cluster.spawn("w-bad").wait(timeout=60)
    return cluster


def test_a_crashed_worker_fails_the_close(mongo_uri: str, db_name: str, tmp_path: Path) -> None:
    cluster = crashing(mongo_uri, db_name, tmp_path)
    with pytest.raises(AssertionError, match=r"worker\(s\) crashed: \['w-bad'\]") as raised:
        cluster.close()
    assert "exit 2" in str(raised.value)


def test_an_expected_exit_and_a_clean_stop_pass(
    mongo_uri: str, db_name: str, tmp_path: Path
) -> None:
    cluster = crashing(mongo_uri, db_name, tmp_path)
    cluster.expect_exit("w-bad")
    cluster.app = "workerapp:registry"
    cluster.spawn("w-good")
    cluster.close()  # w-good stops on SIGTERM with 0; w-bad's exit was expected
    assert cluster.procs == {}
