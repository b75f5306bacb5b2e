"""The cluster gauges of one scrape come from one pass of reads (``metrics.Passes``)."""

from __future__ import annotations

import pytest

from mtask import metrics


class FakeTime:
    """``time`` as ``mtask.metrics`` sees it: a monotonic clock the test moves."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeTime:
    fake = FakeTime()
    monkeypatch.setattr(metrics, "time", fake)
    monkeypatch.setattr(metrics, "CLUSTER_PASSES", metrics.Passes())
    return fake


def test_a_scrape_never_mixes_a_fresh_queue_with_a_limit_read_a_pass_before(
    clock: FakeTime,
) -> None:
    world = {"queue": 1, "in_use": 1}  # a run of a limited name: its task open, its slot held
    reads: list[str] = []

    def depth() -> int:
        reads.append("depth")
        return world["queue"]

    def states() -> int:  # a slow read between the two (the open states' explanations)
        reads.append("states")
        clock.now += 1.0
        return world["queue"]

    def in_use() -> int:
        reads.append("in_use")
        return world["in_use"]

    gauges = [metrics.Fetched(f, -1) for f in (depth, states, in_use)]

    def scrape() -> list[int]:
        return [gauge() for gauge in gauges]  # a scrape asks them in the registry's order

    assert scrape() == [1, 1, 1]
    world.update(queue=0, in_use=0)  # the run ended: its outcome written, its slot given back
    clock.now += 0.1
    assert scrape() == [1, 1, 1]  # read again at most once every DEPTH_TTL: one read each
    assert reads == ["depth", "states", "in_use"]
    # the queue depth's read is DEPTH_TTL old here, the later ones' a second less: every gauge
    # is read again all the same, in one pass
    clock.now = metrics.DEPTH_TTL
    assert scrape() == [0, 0, 0]
    assert reads == ["depth", "states", "in_use"] * 2


def test_a_failed_read_keeps_its_last_figures_until_the_next_pass(clock: FakeTime) -> None:
    answers: list[int | Exception] = [3, ConnectionError("MongoDB out of reach"), 5]

    def read() -> int:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    gauge = metrics.Fetched(read, 0)
    assert gauge() == 3
    clock.now += metrics.DEPTH_TTL
    assert gauge() == 3  # the read failed: the last figures
    assert gauge() == 3  # and is not tried again within the pass
    clock.now += metrics.DEPTH_TTL
    assert gauge() == 5
