"""Where a change stream reopens and when it gives up (``mtask.follow.events.Position``): the pure
half of the reopen loop shared by ``events`` and the waiters."""

from __future__ import annotations

import pytest
from pymongo.errors import AutoReconnect, OperationFailure

from mtask.errors import EventsLost, StorageError
from mtask.follow.events import REFUSED, Position

OPENED = {"_data": "82AA"}
LATER = {"_data": "82BB"}


def failure(code: int, *labels: str) -> OperationFailure:
    return OperationFailure("boom", code, {"code": code, "errorLabels": list(labels)})


def test_the_position_follows_the_stream_from_its_opening() -> None:
    at = Position()
    at.opened(OPENED)  # the opening aggregate's postBatchResumeToken: never "now" on a reopen
    assert at.token == OPENED
    at.moved(None)  # the driver had nothing newer
    assert at.token == OPENED
    at.moved(LATER)
    assert at.token == LATER


def test_a_killed_getmore_is_retried_from_the_same_position_with_backoff() -> None:
    at = Position(give_up_after=10)
    at.opened(OPENED)
    killed = failure(237)  # CursorKilled: not resumable for the driver
    assert [at.failed(killed, now) for now in (0, 1, 2, 3)] == [0.05, 0.1, 0.2, 0.4]
    assert at.token == OPENED
    with pytest.raises(StorageError, match="failed for 10 s"):
        at.failed(AutoReconnect("down"), 10.5)
    at.opened(LATER)  # an open resets the backoff and the failing period
    assert at.failed(killed, 100) == 0.05


def test_lost_history_raises_for_events_and_opens_afresh_for_a_waiter() -> None:
    lost = failure(286)  # ChangeStreamHistoryLost
    with pytest.raises(EventsLost, match="history is lost"):
        Position(OPENED).failed(lost, 0)
    waiter = Position(fresh_when_lost=True)
    waiter.opened(OPENED)
    assert waiter.failed(lost, 0) == 0.05 and waiter.token is None
    waiter.token = LATER
    waiter.lost("the collection was dropped or renamed")
    assert waiter.token is None


def test_a_refused_caller_token_is_lost_but_a_resumable_error_is_retried() -> None:
    with pytest.raises(EventsLost, match="cannot resume after token 82AA"):
        Position(OPENED).failed(failure(2), 0)  # BadValue before the stream ever opened
    at = Position(OPENED)
    assert at.failed(failure(91, "ResumableChangeStreamError"), 0) == 0.05
    at.opened(LATER)
    assert at.failed(failure(2), 1) == 0.05  # once open, the token was ours: retried


def test_a_refused_stream_is_said_once_and_tried_again_less_often(
    caplog: pytest.LogCaptureFixture,
) -> None:
    at = Position(fresh_when_lost=True)
    refused = OperationFailure(
        "not authorized on m to execute command { aggregate: 1, pipeline: [ ... ] }", 13
    )
    assert [at.failed(refused, now) for now in (1.0, 2.0, 3.0)] == [REFUSED] * 3
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "refused" in said[0] and "pipeline" not in said[0], said
    at.opened(OPENED)  # granted: a later refusal is said again
    at.failed(refused, 4.0)
    assert len(caplog.records) == 2
