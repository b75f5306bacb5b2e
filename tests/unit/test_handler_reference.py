"""``docs/handler-context.md`` is ``TaskContext``'s: every field, property and method a handler
may use is on the page with its docstring, none lacks one, and the page is what
``mtask.cli.handler_reference`` writes from the code today."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

from mtask.cli.handler_reference import WORKER_SIDE, field_docs, render
from mtask.registry import TaskContext

PAGE = Path(__file__).parents[2] / "docs" / "handler-context.md"


def test_the_page_is_what_the_code_says_today() -> None:
    assert PAGE.read_text() == render(), (
        "docs/handler-context.md is stale: "
        "python -m mtask.cli.handler_reference > docs/handler-context.md"
    )


def test_every_public_member_is_on_the_page_with_a_docstring() -> None:
    """Checked from the class, apart from how ``render`` lays it out: a new field without a
    docstring, or a method the page does not name, fails."""
    page = PAGE.read_text()
    docs = field_docs()
    for f in dataclasses.fields(TaskContext):
        if f.name.startswith("_"):
            continue
        assert docs.get(f.name), f"TaskContext.{f.name} has no docstring"
        assert f"`ctx.{f.name}`" in page or f"`{f.name}`" in page, f.name
    data = {f.name for f in dataclasses.fields(TaskContext)}  # a default may be a function
    for name, value in vars(TaskContext).items():
        member = inspect.isfunction(value) or isinstance(value, property)
        if name.startswith("_") or name in data or not member:
            continue
        assert inspect.getdoc(value), f"TaskContext.{name} has no docstring"
        shown = f"ctx.{name}(" in page or f"### `ctx.{name}`" in page
        assert shown or name in WORKER_SIDE, f"TaskContext.{name} is not on the page"
    assert "### `await ctx.wait_for(signal, timeout=None, name=None)`" in page
    assert "| `ctx.attempt` | `int` |" in page
