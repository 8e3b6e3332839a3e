"""Package faces that import a name's module only when the name is first used (PEP 562)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from importlib import import_module
from typing import Any


def lazy_attributes(package: str, modules: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``: ``name`` -> ``getattr(import_module(modules[name]), name)``.

    Used as ``__getattr__ = lazy_attributes(__name__, {...})`` so that importing the package does
    not import Ray, vLLM or transformers until one of their names is asked for.
    """

    def __getattr__(name: str) -> Any:
        if name in modules:
            return getattr(import_module(modules[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
