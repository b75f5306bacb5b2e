"""The package version, in one place; and ``lazy_exports``, how a package's surface imports its
names on first use (PEP 562: ``mtask``, ``mtask.steps``, ``mtask.contrib.django``). The one
module ``import mtask`` loads (``tests/unit/test_lazy_imports.py``), and it imports no other of
mtask's: every package may use it without an import reaching back up to the root."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__version__ = "0.1.0"


def lazy_exports(
    package: str, where: Mapping[str, tuple[str, ...]], namespace: dict[str, Any]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``package``'s ``__getattr__`` and ``__dir__``: each name of ``where`` (module: names)
    imported from its module on first use and kept in ``namespace`` (the package's
    ``globals()``), so that the next lookup is a plain one."""
    module_of = {name: module for module, names in where.items() for name in names}

    def __getattr__(name: str) -> Any:
        module = module_of.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value  # the next lookup is a plain one
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *module_of})

    return __getattr__, __dir__
