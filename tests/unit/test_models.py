"""Bad input raises InvalidTask naming the field, before anything reaches MongoDB."""

from __future__ import annotations

import datetime as dt
import re
from typing import Any

import bson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mtask import InvalidTask, MtaskError, TaskOptions
from mtask.client import build_many, build_task
from mtask.models import NewTask, Task, _read_each_option, _read_options
from mtask.store.schema import new_document
from mtask.vocabulary import (
    MAX_KEY_LENGTH,
    OPTION_DEFAULTS,
    OPTION_FIELD_DEFAULTS,
    OPTION_NAMES,
    PARAMS_BYTES_CEILING,
)

NOW = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
PLUS_14 = dt.timezone(dt.timedelta(hours=14))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"key": ""}, "key"),
        ({"key": "   "}, "key"),
        ({"key": "k" * (MAX_KEY_LENGTH + 1)}, "key"),
        ({"key": 12}, "key"),
        ({"key": "a\x00b"}, "key"),
        ({"name": ""}, "name"),
        ({"name": None}, "name"),
        ({"params": [1, 2]}, "params"),
        ({"params": {"x": object()}}, "params"),
        ({"params": {"x": 2**70}}, "params"),
        ({"options": {"nope": 1}}, "options.nope"),
        ({"options": {"worker_timeout_ms": -5}}, "options.worker_timeout_ms"),
        ({"options": {"ping_interval_ms": -1}}, "options.ping_interval_ms"),
        ({"options": {"max_retries": -1}}, "options.max_retries"),
        ({"options": {"concurrency": 0}}, "options.concurrency"),
        ({"options": {"run_at": "2026-01-01T00:00:00"}}, "options.run_at"),
        ({"options": "fast"}, "options"),
        # passes every other check, but BSON (UTF-8) cannot hold it
        ({"key": "\ud800"}, "key"),
        ({"name": "a\udfff"}, "name"),
        ({"params": {"\udc80": 1}}, "params"),
        ({"params": {"x": ["\udc80"]}}, "params"),
        ({"options": {"specific_worker_ids": ["\ud800"]}}, "options.specific_worker_ids"),
        # UTC (BSON's) is before the year 1 or after 9999
        ({"options": {"run_at": "0001-01-01T00:00:00+14:00"}}, "options.run_at"),
        ({"options": {"run_at": dt.datetime(1, 1, 1, tzinfo=PLUS_14)}}, "options.run_at"),
        ({"options": {"run_at": "9999-12-31T23:59:59-14:00"}}, "options.run_at"),
    ],
)
def test_bad_input_names_the_field(kwargs: dict[str, object], field: str) -> None:
    args: dict[str, object] = {"name": "n", "key": "k", "params": {}, "options": None} | kwargs
    with pytest.raises(InvalidTask) as info:
        NewTask.build(args["name"], args["key"], args["params"], args["options"])
    assert str(info.value).startswith(field), str(info.value)
    assert isinstance(info.value, MtaskError)


def test_a_validated_task_is_always_encodable() -> None:
    """Every check of NewTask.build is what writing it needs: a task it accepts is a document
    BSON can hold (else publish_many wrote the tasks before it, then failed)."""
    task = NewTask.build(
        "n\u00e9",
        "k\U0001f600",
        {"x": "\u20ac"},
        {"run_at": "9999-12-31T23:59:59+14:00", "specific_worker_ids": ["w\u00e9"]},
        depends_on=["d\U0001f600"],
    )
    bson.encode(new_document(task, NOW))


def test_params_over_the_ceiling_are_refused_whatever_the_limit() -> None:
    big = {"blob": "x" * (PARAMS_BYTES_CEILING + 1)}
    limit = f"the limit is {PARAMS_BYTES_CEILING}$"
    with pytest.raises(InvalidTask, match=f"^params: is \\d+ bytes as BSON; {limit}"):
        NewTask.build("n", "k", big, max_params_bytes=2**31)


@pytest.mark.parametrize(
    ("delay", "message"),
    [
        ("abc", "must be a number of seconds or a timedelta, not str"),
        ("5", "must be a number of seconds or a timedelta, not str"),
        ({}, "must be a number of seconds or a timedelta, not dict"),
        ([1], "must be a number of seconds or a timedelta, not list"),
        (True, "must be a number of seconds or a timedelta, not bool"),
        (10**400, "must be at most ten years"),
        (float("inf"), "must be at most ten years"),
        (float("nan"), "must not be negative"),
        (dt.timedelta(days=-1), "must not be negative"),
    ],
)
def test_a_bad_delay_is_invalid_task(delay: object, message: str) -> None:
    with pytest.raises(InvalidTask, match=f"^delay: {re.escape(message)}$"):
        build_task("n", "k", delay=delay, now=NOW)  # type: ignore[arg-type]
    with pytest.raises(InvalidTask, match=f"^items\\[0\\].delay: {re.escape(message)}$"):
        build_many([{"name": "n", "key": "k", "delay": delay}], NOW, 1 << 20)


def test_params_size_limit_is_configurable() -> None:
    big = {"blob": "x" * 2000}
    NewTask.build("n", "k", big)  # under the default 1 MiB
    with pytest.raises(InvalidTask, match=r"^params: is \d+ bytes as BSON; the limit is 1000"):
        NewTask.build("n", "k", big, max_params_bytes=1000)


def test_delay_sets_run_at_from_server_now() -> None:
    task = build_task("n", "k", delay=dt.timedelta(seconds=90), now=NOW)
    assert task.options.run_at == NOW + dt.timedelta(seconds=90)
    with pytest.raises(InvalidTask, match="^delay: must not be negative"):
        build_task("n", "k", delay=-1, now=NOW)
    with pytest.raises(InvalidTask, match="^delay: give either"):
        build_task("n", "k", options={"run_at": NOW}, delay=1, now=NOW)


def test_build_many_names_the_item() -> None:
    with pytest.raises(InvalidTask, match=re.escape("items[1].key: must not be empty")):
        build_many([{"name": "a", "key": "x"}, {"name": "a", "key": ""}], NOW, 1 << 20)
    with pytest.raises(InvalidTask, match=re.escape("items[0]: unknown field(s) prio")):
        build_many([{"name": "a", "key": "x", "prio": 1}], NOW, 1 << 20)


def test_options_defaults_and_document() -> None:
    opts = TaskOptions(specific_worker_ids=("w1",))
    doc = opts.to_document()
    assert doc["concurrency"] == 1 and doc["specific_worker_ids"] == ["w1"]
    assert doc["max_retries"] == 3 and doc["run_at"] is None


def test_every_option_takes_its_default_from_the_one_table() -> None:
    """``TaskOptions``' fields and ``vocabulary.OPTION_FIELD_DEFAULTS`` name the same options in
    the same order, each field's default the table's (a field given a default of its own would
    leave the worker, which reads the table, completing documents with another one)."""
    fields = TaskOptions.model_fields
    assert tuple(fields) == OPTION_NAMES
    assert {name: f.get_default(call_default_factory=True) for name, f in fields.items()} == (
        OPTION_FIELD_DEFAULTS
    )
    assert TaskOptions().to_document() == OPTION_DEFAULTS


_OPTION_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**40), max_value=2**40),
    st.floats(allow_nan=True),
    st.text(max_size=4),
    st.lists(st.text(max_size=3), max_size=2),
    st.datetimes(timezones=st.one_of(st.none(), st.just(dt.UTC))),
)


@given(
    st.dictionaries(
        st.one_of(st.sampled_from(sorted(TaskOptions.model_fields)), st.text(max_size=3)),
        _OPTION_VALUES,
        max_size=8,
    )
)
def test_stored_options_read_at_once_as_one_by_one(options: dict[str, Any]) -> None:
    """A document's options are read in one validation when they pass; it must give what
    reading them one by one gives, the problems too (none, or the same named ones)."""
    at_once: list[str] = []
    each: list[str] = []
    assert _read_options(options, at_once) == _read_each_option(options, each)
    assert at_once == each


def test_stored_options_of_a_published_document_are_read_at_once() -> None:
    doc = new_document(NewTask.build("n", "k", {}, {"priority": 3, "group": "g"}), NOW)
    problems: list[str] = []
    stored = _read_options(doc["options"], problems)
    assert (stored.priority, stored.group, stored.concurrency, problems) == (3, "g", 1, [])
    assert Task.from_document(doc).complete
