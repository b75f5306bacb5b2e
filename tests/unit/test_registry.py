"""A ``Registry`` behaves as the collection of names it is."""

from __future__ import annotations

from mtask import Registry

registry = Registry()


@registry.task("resize")
def resize(params: dict[str, int]) -> int:
    return params["w"]


@registry.task("annotate")
async def annotate(params: dict[str, str]) -> str:
    return params["text"]


def test_a_registry_iterates_over_its_names() -> None:
    """``list(registry)`` raised ``KeyError: 0``: with ``__getitem__`` and no ``__iter__``,
    Python iterated by asking for ``registry[0]``."""
    assert list(registry) == ["annotate", "resize"] == registry.names
    assert sorted(name for name in registry) == ["annotate", "resize"]
    assert list(Registry()) == []
    assert "resize" in registry and registry["resize"].fn is resize
