"""A run's output buffer (``mtask.follow.output``), without MongoDB: coalescing, caps, order, and
what a handler's mistakes raise."""

from __future__ import annotations

import datetime as dt
import logging
import threading

import bson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mtask.follow.output import OutputLimits, RecordedOutput, RunOutput

calls = st.lists(
    st.one_of(
        st.tuples(st.just("progress"), st.floats(0, 1)),
        st.tuples(st.just("log"), st.text(max_size=20)),
        st.tuples(st.just("emit"), st.one_of(st.text(max_size=20), st.binary(max_size=20))),
        st.tuples(st.just("take"), st.integers(1, 5)),
    ),
    max_size=200,
)


@settings(max_examples=200, deadline=None)
@given(calls=calls, cap=st.integers(0, 10), chunk_cap=st.integers(0, 200))
def test_what_is_taken_is_what_was_said_in_order_within_the_caps(
    calls: list[tuple[str, object]], cap: int, chunk_cap: int
) -> None:
    limits = OutputLimits(max_log_lines=cap, max_chunk_bytes_per_run=chunk_cap)
    wakes: list[int] = []
    out = RunOutput(limits, wake=lambda _o: wakes.append(1))
    said_logs: list[str] = []
    said_chunks: list[object] = []
    last_progress = None
    taken: list[dict[str, object]] = []
    progress_taken = None
    for kind, value in calls:
        if kind == "progress":
            out.progress(value)  # type: ignore[arg-type]
            last_progress = value
        elif kind == "log":
            out.log.info(value)
            said_logs.append(str(value))
        elif kind == "emit":
            out.emit(value)
            said_chunks.append(value)
        else:
            batch = out.take(value)  # type: ignore[arg-type]
            taken += batch.entries
            progress_taken = batch.progress or progress_taken
    rest = RecordedOutput.of(out)
    taken += rest.logs + [{"kind": "chunk", "data": c} for c in rest.chunks]
    progress_taken = rest.progress or progress_taken
    # the newest progress always lands
    assert (progress_taken or {}).get("fraction") == last_progress
    logs = [e["message"] for e in taken if e["kind"] == "log" and "fields" not in e]
    chunks = [e["data"] for e in taken if e["kind"] == "chunk"]
    assert logs == said_logs[:cap]  # the first lines up to the cap, in order
    assert chunks == said_chunks[: len(chunks)]  # a prefix, in order
    markers = [e for e in taken if e.get("fields") == {"truncated": True}]
    assert len(markers) == (len(said_logs) > cap) + (len(chunks) < len(said_chunks))
    # one wake per empty -> not-empty transition at most
    assert len(wakes) <= len([c for c in calls if c[0] != "take"])


def test_progress_coalesces_to_the_newest_value() -> None:
    out = RunOutput()
    for i in range(10_000):
        out.progress(i / 10_000, f"{i}")
    batch = out.take()
    assert batch.progress == {"fraction": 0.9999, "label": "9999"} and not batch.entries
    assert not out.take()


def test_a_handlers_mistakes_raise_clear_errors() -> None:
    out = RunOutput(OutputLimits(max_chunk_bytes=100))
    with pytest.raises(ValueError, match="between 0 and 1"):
        out.progress(1.5)
    with pytest.raises(TypeError, match="must be a number"):
        out.progress("half")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="storable as BSON"):
        out.emit(object())
    with pytest.raises(ValueError, match="at most 100 bytes"):
        out.emit("x" * 200)
    with pytest.raises(ValueError, match="log level"):
        out.line("loud", "x", {})
    assert not out.used


def test_nothing_is_kept_once_closed_and_discard_forgets() -> None:
    out = RunOutput()
    out.emit("a")
    out.discard()
    assert not out.take()
    out.close()
    out.emit("b")
    out.progress(0.5)
    assert not out.take()


def test_capture_keeps_this_threads_records_only() -> None:
    out = RunOutput()
    logger = logging.getLogger("mtask.test.capture")
    logger.setLevel(logging.INFO)
    with out.log.capture(logger):
        logger.info("mine %d", 1)
        other = threading.Thread(target=lambda: logger.info("another run's"))
        other.start()
        other.join()
        logger.debug("below the level")
    logger.info("after the block")
    recorded = RecordedOutput.of(out)
    assert [e["message"] for e in recorded.logs] == ["mine 1"]
    assert recorded.logs[0]["fields"] == {"logger": "mtask.test.capture"}


def test_what_is_said_is_taken_as_it_was_when_said() -> None:
    """The buffer kept the handler's objects: a reused row was stored N times with its last
    value, and a value made non-BSON after the call broke the run's output writer."""
    out = RunOutput()
    row: dict[str, object] = {}
    for i in range(3):
        row["i"] = i
        out.emit(row)
    fields: dict[str, object] = {"tags": ["a"]}
    out.log.info("tagged", **fields)
    fields["tags"].append(dt.date(2026, 1, 1))  # type: ignore[attr-defined]
    row["day"] = dt.date(2026, 1, 1)  # not BSON: what was said is not changed by it
    entries = out.take().entries
    assert [e["data"] for e in entries if e["kind"] == "chunk"] == [{"i": 0}, {"i": 1}, {"i": 2}]
    [line] = [e for e in entries if e["kind"] == "log"]
    assert line["fields"] == {"tags": ["a"]}
    bson.encode({"entries": entries})  # storable as taken
