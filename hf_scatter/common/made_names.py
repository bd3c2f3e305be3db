"""Objects a module makes at run time (classes, functions) and pickle must find by module and name.

The module keeps them in one dict it owns, never in its ``globals()``, and answers lookups of those names with
the ``__getattr__`` this file makes (PEP 562), which is all pickle and ``copy`` need."""

from __future__ import annotations

from typing import Callable


def module_getattr(table: dict, module: str) -> Callable[[str], object]:
    """A module-level ``__getattr__`` for ``module`` that finds names in ``table``."""

    def __getattr__(name: str):
        try:
            return table[name]
        except KeyError:
            raise AttributeError(f"module {module!r} has no attribute {name!r}") from None

    return __getattr__
