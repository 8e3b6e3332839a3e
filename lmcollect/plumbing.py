"""Class plumbing every layer shares: read-only properties that pass an attribute on, and
context-manager support for objects that end with ``close()`` or ``shutdown()``."""

from __future__ import annotations

import operator
from typing import Any, Self


def forwarded(path: str, doc: str) -> Any:
    """A read-only property returning ``self.<path>``; ``path`` may be dotted (``"_flow.num_consumed"``).

    For an attribute that only passes on one the object holds, or one of its parts holds:
    ``turns_yielded = forwarded("_flow.num_consumed", "Turns that left in batches so far.")``.
    Setting or deleting it raises AttributeError, as for any property without a setter.
    Annotated ``Any`` (it is a ``property``): the value's type is that of the attribute ``path``
    names, which a type checker cannot follow through a string, so it must not read it as ``property``.
    """
    return property(operator.attrgetter(path), doc=doc)


class EntersAsSelf:
    """``with obj as x:`` binds ``x`` to ``obj`` itself; a subclass says in ``__exit__`` how it ends."""

    def __enter__(self) -> Self:
        return self


class ClosesOnExit(EntersAsSelf):
    """``with obj:`` calls ``obj.close()`` on the way out (after an error too)."""

    close: Any  # the host's own close()

    def __exit__(self, *exc: object) -> None:
        self.close()


class ShutsDownOnExit(EntersAsSelf):
    """``with obj:`` calls ``obj.shutdown()`` on the way out (after an error too): the collectors."""

    shutdown: Any  # the host's own shutdown()

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
