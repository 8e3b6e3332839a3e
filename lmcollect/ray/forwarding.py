"""Methods and attributes of a Ray proxy that forward to the object in its actor, typed as the local ones.

A Ray collector lists what it forwards in its class body, one line each::

    class RayLLMCollector:
        version_index = forward(LLMCollector.version_index)
        turns_run = forward_attribute(LLMCollector.turns_run)

Each line makes a method (or a read-only property) that calls the actor through the proxy's
``_call(name, *args, **kwargs)``, and carries the local member's name, signature and docstring:
``help()``, ``inspect.signature``, mypy (through the ``ParamSpec``) and the API pages
(``docs/griffe_forwards.py``) all see the local collector's member. Adding a forward is adding a line.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar, overload

P = ParamSpec("P")
R = TypeVar("R")


def forward(local: Callable[Concatenate[Any, P], R]) -> Callable[Concatenate[Any, P], R]:
    """A method calling the actor's method of ``local``'s name with its arguments (``self._call``)."""
    name = local.__name__

    def call(self: Any, *args: P.args, **kwargs: P.kwargs) -> R:
        result: R = self._call(name, *args, **kwargs)
        return result

    functools.update_wrapper(call, local)  # name, docstring and (through __wrapped__) signature
    call.forwarded_to = name  # type: ignore[attr-defined]  # marks it as a forward (see is_forward)
    return call


class forward_attribute(property, Generic[R]):  # lower case: used like ``property``
    """A read-only property reading the actor's attribute of ``local``'s name (``get_attribute``).

    ``local`` is the local class's property; the type checker sees a property read on its class
    as its getter, hence the ``Callable`` annotation.
    """

    def __init__(self, local: Callable[[Any], R]) -> None:
        getter = _property_getter(local)
        name = getter.__name__

        def read(proxy: Any) -> R:
            value: R = proxy._call("get_attribute", name)
            return value

        read.__name__ = read.__qualname__ = name
        super().__init__(read)
        self.__doc__ = getter.__doc__  # the instance's own (a subclass's class docstring would shadow doc=)
        self.forwarded_to = name

    @overload
    def __get__(self, instance: None, owner: type | None = None) -> forward_attribute[R]: ...
    @overload
    def __get__(self, instance: object, owner: type | None = None) -> R: ...
    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        return super().__get__(instance, owner)


def _property_getter(local: Any) -> Callable[[Any], Any]:
    if not isinstance(local, property) or local.fget is None:
        raise TypeError(f"forward_attribute() takes a class's property (e.g. LLMCollector.turns_run), got {local!r}.")
    return local.fget
