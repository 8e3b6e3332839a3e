"""Resolves paths like ``_receiver_schemes['policy'].connect`` by attribute and item access only.

A path is a remote caller's way into the collector, so it reaches public attributes only, plus
the two private names the collector's documentation shows (``_receiver_schemes`` and the schemes'
``_set_dist_connection_info``): a dunder (``__globals__``, ``__class__``) or any other
``_``-prefixed segment is refused before anything is looked up.
"""

from __future__ import annotations

import ast
import re
from typing import Any

# the documented private entry points (RayLLMCollector.cascade_execute's example path)
ALLOWED_PRIVATE_NAMES = frozenset({"_receiver_schemes", "_set_dist_connection_info"})
_TOKEN = re.compile(r"""\.?([A-Za-z_][A-Za-z0-9_]*)|\[\s*('(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*"|-?\d+)\s*\]""")


def parse_attr_path(path: str) -> list[tuple[str, str | int]]:
    """``a.b['k'][0]`` -> [("attr", "a"), ("attr", "b"), ("item", "k"), ("item", 0)]."""
    steps: list[tuple[str, str | int]] = []
    pos = 0
    while pos < len(path):
        match = _TOKEN.match(path, pos)
        if match is None:
            raise ValueError(f"cannot parse attr_path {path!r} at position {pos}: use a.b['key'][0] forms only.")
        if match.group(1) is not None:
            if pos > 0 and path[pos] != ".":
                raise ValueError(f"cannot parse attr_path {path!r} at position {pos}: missing '.'.")
            steps.append(("attr", _public_name(path, match.group(1))))
        else:
            # literal_eval of a quoted string or an int literal only: never code
            steps.append(("item", ast.literal_eval(match.group(2))))
        pos = match.end()
    if not steps:
        raise ValueError("attr_path is empty; pass e.g. \"_receiver_schemes['policy'].receive\".")
    return steps


def resolve_attr_path(root: Any, path: str) -> Any:
    obj = root
    for kind, name in parse_attr_path(path):
        if kind == "attr":
            assert isinstance(name, str), "parse_attr_path gives attribute steps as names"
            obj = getattr(obj, name)
        else:
            obj = obj[name]
    return obj


def _public_name(path: str, name: str) -> str:
    if name.startswith("_") and name not in ALLOWED_PRIVATE_NAMES:
        raise ValueError(
            f"attr_path {path!r} names the private attribute {name!r}: paths reach public attributes only "
            f"(and {sorted(ALLOWED_PRIVATE_NAMES)}); call a public method instead, "
            "e.g. \"_receiver_schemes['policy'].set_connection_info\"."
        )
    return name
