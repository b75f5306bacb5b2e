"""A worker's log is text: a limit document's ``_id`` (``\\x00smtp`` for a resource) is
logged by its label, and any control character in an event's value is escaped."""

from __future__ import annotations

import logging

import pytest

from mtask.limits.rules import group_slot, resource_slot, slot_label
from mtask.worker.worker_events import Emitter, Event


def test_a_slot_is_logged_by_its_label() -> None:
    assert slot_label("send_email") == "send_email"
    assert slot_label(resource_slot("smtp")) == "resource:smtp"
    assert slot_label(group_slot("send_email", "acme")) == "send_email group acme"


def test_an_event_line_holds_no_control_character(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="mtask.worker.events"):
        Emitter()(Event.LIMITS_APPLIED, name="\x00smtp", note="a\nb")
    [line] = [r.getMessage() for r in caplog.records]
    assert line == "limits_applied name=\\x00smtp note=a\\x0ab"
