"""Process start-up: tensordict without importing torch's compiler.

When tensordict is imported it marks two of its functions for ``torch.compile``
(``torch.compiler.allow_in_graph`` and ``assume_constant_result``), and each mark imports
``torch._dynamo``: about 2 s of CPU in every process that imports tensordict - each Ray actor,
each CLI run, each test worker - for a compiler lmcollect never calls.

:func:`defer_compiler_marks` (run by ``import lmcollect``) makes a tensordict imported afterwards
record those marks instead, and applies them, unchanged, the moment ``torch._dynamo`` is imported
by anyone (``torch.compile``, vLLM, a model): compiled code sees tensordict as it always did. A
tensordict imported before lmcollect, or a process that already imported the compiler, is left alone.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from importlib.abc import Loader, MetaPathFinder
from importlib.machinery import ModuleSpec, PathFinder
from types import ModuleType
from typing import Any

__all__ = ["defer_compiler_marks"]

COMPILER = "torch._dynamo"
_lock = threading.Lock()
_pending: list[Callable[..., Any]] = []
"""Functions marked ``allow_in_graph`` while the compiler was not imported."""


def allow_in_graph(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.compiler.allow_in_graph``, recorded until the compiler is imported."""
    with _lock:
        if COMPILER not in sys.modules:
            _pending.append(fn)
            return fn
    return sys.modules[COMPILER].allow_in_graph(fn)


def assume_constant_result(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.compiler.assume_constant_result``: the compiler reads only this attribute."""
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn


def _register_pending(compiler: ModuleType) -> None:
    with _lock:
        marked, _pending[:] = list(_pending), []
    for fn in marked:
        compiler.allow_in_graph(fn)


@contextlib.contextmanager
def _marks_recorded() -> Iterator[None]:
    """torch.compiler's two marks swapped for the recording ones while tensordict is imported."""
    import torch.compiler

    saved = torch.compiler.allow_in_graph, torch.compiler.assume_constant_result
    torch.compiler.allow_in_graph, torch.compiler.assume_constant_result = allow_in_graph, assume_constant_result
    try:
        yield
    finally:
        torch.compiler.allow_in_graph, torch.compiler.assume_constant_result = saved


class _Finder(MetaPathFinder):
    """Wraps the loading of tensordict (marks recorded) and of the compiler (marks applied)."""

    def find_spec(self, name: str, path: Sequence[str] | None, target: ModuleType | None = None) -> ModuleSpec | None:
        if name == "tensordict" and COMPILER not in sys.modules:
            return _wrapped(name, path, target, before=_marks_recorded)
        if name == COMPILER and _pending:
            return _wrapped(name, path, target, after=_register_pending)
        return None


def _wrapped(
    name: str,
    path: Sequence[str] | None,
    target: ModuleType | None,
    *,
    before: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    after: Callable[[ModuleType], None] = lambda module: None,
) -> ModuleSpec | None:
    spec = PathFinder.find_spec(name, path, target)
    if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
        return None  # not a plain file-system module: the usual import machinery takes it
    loader: Loader = spec.loader
    exec_module = loader.exec_module

    def exec_wrapped(module: ModuleType) -> None:
        with before():
            exec_module(module)
        after(module)

    loader.exec_module = exec_wrapped  # type: ignore[method-assign]
    return spec


def defer_compiler_marks() -> None:
    """Install the finder (once); see the module's docstring."""
    if "tensordict" in sys.modules or COMPILER in sys.modules:
        return
    if not any(isinstance(finder, _Finder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
