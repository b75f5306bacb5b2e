"""The registry of the triggers' chaos test (test_trigger_kills.py): a trigger on ``orders``
publishing ``ship`` for each change to a paid order. Its workers run ``idle`` only, so the
published tasks stay pending and are counted as they are."""

from __future__ import annotations

from typing import Any

from mtask.registry import Registry

registry = Registry()


@registry.task("ship")
def ship(params: dict[str, Any]) -> None:
    return None


@registry.task("idle")
def idle(params: dict[str, Any]) -> None:
    return None


registry.trigger("orders", task="ship", match={"kind": "paid"}, on=["insert", "update"])
