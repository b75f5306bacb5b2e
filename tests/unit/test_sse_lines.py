"""The harness's reader of server-sent events (tests/harness/sse.py), on lines as a client
gets them."""

from __future__ import annotations

from harness import server_sent
from hypothesis import given
from hypothesis import strategies as st


def test_events_end_at_a_blank_line_and_comments_come_as_they_are() -> None:
    lines = [": open", "event: task", "id: 7", 'data: {"a": 1}', "", ": keep-alive", "data:x", ""]
    assert list(server_sent(lines)) == [
        ": open",
        {"event": "task", "id": "7", "data": '{"a": 1}'},
        ": keep-alive",
        {"data": "x"},
    ]


def test_an_event_not_ended_by_a_blank_line_is_not_one_and_blank_lines_alone_are_nothing() -> None:
    assert list(server_sent(["", "", "event: end", "data: {}"])) == []


values = st.text(st.characters(blacklist_characters="\r\n"), max_size=20)


@given(st.lists(st.tuples(st.sampled_from(["event", "id", "data"]), values), min_size=1))
def test_a_field_reads_back_as_written_once_its_leading_space_is_dropped(
    fields: list[tuple[str, str]],
) -> None:
    lines = [f"{name}: {value}" for name, value in fields] + [""]
    assert list(server_sent(lines)) == [dict(fields)]
