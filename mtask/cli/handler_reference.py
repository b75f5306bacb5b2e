"""What a handler receives (``docs/handler-context.md``), written from ``TaskContext`` itself:
its fields with their docstrings (read from the class's source: a dataclass keeps none at run
time), then its properties and methods with their signatures and docstrings.
``python -m mtask.cli.handler_reference > docs/handler-context.md`` writes it;
``tests/unit/test_handler_reference.py`` fails when the page is stale or a member has no
docstring."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import textwrap
from typing import Any

from mtask.registry import TaskContext

HEADER = """\
# What a handler receives

<!-- Written by `python -m mtask.cli.handler_reference > docs/handler-context.md` from
mtask/registry.py; tests/unit/test_handler_reference.py fails when it is stale. Edit the
docstrings, not this. -->

A handler takes `(params)` or `(params, ctx)`: `params` is the task's params as stored (a dict),
or an instance of the pydantic model its first parameter is annotated with (params the model
refuses fail the task for good, `InvalidParams`); `ctx` is a `TaskContext`, below. A batch
handler (`@registry.task(name, batch=100)`) takes a list of `BatchItem`s instead, each with its
`key`, `params` and `ctx`. What a handler may raise (`Retry`, `Fail`, `Snooze`, `BackOff`) is
in the [README](../README.md) and [flow-control.md](flow-control.md); durable steps are in
[steps.md](steps.md), output in [output.md](output.md)."""

WORKER_SIDE = frozenset(
    {"publisher", "output_for", "steps_for", "output_made", "steps_made", "journal", "release"}
)
"""Members the worker wires and reads, not the handler: named on the page, not described."""


def field_docs() -> dict[str, str]:
    """Each field's docstring: the string right below its annotation in the class's source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(TaskContext)))
    cls = tree.body[0]
    assert isinstance(cls, ast.ClassDef)
    body = cls.body
    docs: dict[str, str] = {}
    for statement, after in zip(body, [*body[1:], None], strict=True):
        text = ""
        if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
            text = str(after.value.value)
        if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
            docs[statement.target.id] = inspect.cleandoc(text)
    return docs


def fields() -> list[tuple[str, str, str]]:
    """The handler's fields: name, type (as annotated), docstring."""
    docs = field_docs()
    return [
        (f.name, str(f.type), docs.get(f.name, ""))
        for f in dataclasses.fields(TaskContext)
        if not f.name.startswith("_") and f.name not in WORKER_SIDE
    ]


def members() -> list[tuple[str, str, str]]:
    """The handler's properties and methods, in the class's order: name, how it is called,
    docstring."""
    found = []
    data = {f.name for f in dataclasses.fields(TaskContext)}  # a default may be a function
    for name, value in vars(TaskContext).items():
        if name.startswith("_") or name in WORKER_SIDE or name in data:
            continue
        if isinstance(value, property):
            found.append((name, f"ctx.{name}", inspect.getdoc(value) or ""))
        elif inspect.isfunction(value):
            found.append((name, call(name, value), inspect.getdoc(value) or ""))
    return found


def call(name: str, fn: Any) -> str:
    """``await ctx.step(name, fn, *args, transactional=False, policy=None, **kwargs)``."""
    parts = []
    for p in list(inspect.signature(fn).parameters.values())[1:]:
        if p.kind is p.VAR_POSITIONAL:
            parts.append(f"*{p.name}")
        elif p.kind is p.VAR_KEYWORD:
            parts.append(f"**{p.name}")
        elif p.default is p.empty:
            parts.append(p.name)
        else:
            if p.kind is p.KEYWORD_ONLY and not any(x.startswith("*") for x in parts):
                parts.append("*")
            parts.append(f"{p.name}={p.default!r}")
    returns = str(inspect.signature(fn).return_annotation)
    awaited = inspect.iscoroutinefunction(fn) or returns.startswith("Coroutine")
    return f"{'await ' if awaited else ''}ctx.{name}({', '.join(parts)})"


def markdown(text: str) -> str:
    """A docstring as Markdown: RST's ``code`` as `code`, its lines joined."""
    return re.sub(r"\s*\n\s*", " ", text.replace("``", "`")).strip()


def render() -> str:
    """The whole page, as ``docs/handler-context.md`` holds it."""
    lines = [HEADER, "", "## Fields", "", "| field | type | what it holds |", "| --- | --- | --- |"]
    for name, kind, doc in fields():
        cell = markdown(doc).replace("|", "\\|")
        lines.append(f"| `ctx.{name}` | `{kind}` | {cell} |")
    lines += ["", "## Properties and methods", ""]
    lines.append(
        "Each `*_sync` method is its namesake for a plain-`def` handler (on its thread or in "
        "its child process)."
    )
    for _name, how, doc in members():
        lines += ["", f"### `{how}`", "", markdown(doc)]
    worker = ", ".join(f"`{n}`" for n in sorted(WORKER_SIDE))
    lines += [
        "",
        "## The worker's own",
        "",
        f"{worker}: the worker wires and reads these; a handler does not need them.",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(render(), end="")
