"""A Griffe extension for the API reference: a Ray proxy's forwarded members shown as the local ones.

``lmcollect/ray/forwarding.py`` makes a Ray collector's methods from one line each
(``reset = forward(LLMCollector.reset)``, ``turns_run = forward_attribute(LLMCollector.turns_run)``).
Griffe reads the source without running it, so it would see attributes with no docstring and
hide them. This replaces each such attribute with a copy of the member it forwards (signature,
return type, docstring, ``property`` label), under the proxy's name. Loaded by ``mkdocs.yml``.
"""

from __future__ import annotations

from typing import Any

import griffe

FORWARD_FUNCTIONS = frozenset({"forward", "forward_attribute"})


def _forwarded_target(attr: griffe.Attribute) -> str | None:
    """The path of the member ``attr`` forwards, or None if it is no forward."""
    value = attr.value
    if not isinstance(value, griffe.ExprCall) or str(value.function) not in FORWARD_FUNCTIONS:
        return None
    return value.arguments[0].canonical_path if value.arguments else None


def _copy_of(target: griffe.Object, source: griffe.Attribute) -> griffe.Object:
    """``target`` as a member of ``source``'s class, where ``source`` stands in the source."""
    if isinstance(target, griffe.Function):
        copy: griffe.Object = griffe.Function(
            source.name,
            lineno=source.lineno,
            endlineno=source.endlineno,
            parameters=target.parameters,
            returns=target.returns,
        )
    else:
        copy = griffe.Attribute(
            source.name, lineno=source.lineno, endlineno=source.endlineno, annotation=target.annotation
        )
    copy.labels |= target.labels
    if target.docstring is not None:
        copy.docstring = griffe.Docstring(target.docstring.value, parser=target.docstring.parser, parent=copy)
    return copy


class ForwardedMembers(griffe.Extension):
    """Replace every ``forward(...)`` / ``forward_attribute(...)`` class attribute with its target's copy."""

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        for cls in _classes(pkg):
            for name, member in list(cls.members.items()):
                if not isinstance(member, griffe.Attribute):
                    continue
                path = _forwarded_target(member)
                if path is not None:
                    cls.set_member(name, _copy_of(loader.modules_collection[path], member))


def _classes(obj: griffe.Object) -> list[griffe.Class]:
    found = []
    for member in obj.members.values():
        if member.is_alias:
            continue
        if isinstance(member, griffe.Class):
            found.append(member)
        if isinstance(member, (griffe.Module, griffe.Class)):
            found.extend(_classes(member))
    return found
