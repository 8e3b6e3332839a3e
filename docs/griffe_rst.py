"""A Griffe extension for the API reference: our docstrings' RST inline markup, shown as Markdown.

lmcollect's docstrings are prose with reStructuredText markup: ``double backticks`` (a code span in
Markdown too), roles such as :class:`~lmcollect.buffers.ReplayBuffer`, and ``Example::`` before an
indented block. Markdown would show the roles and the ``::`` literally, so this rewrites the
docstrings Griffe has read (the source files are untouched): a role becomes a code span of its
target as written (``~`` keeps only the last part, as in Sphinx), and a line-ending ``::`` becomes
``:`` (the indented block after it is a Markdown code block already). Loaded by ``mkdocs.yml``.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(?:class|meth|func|mod|attr|data|exc|obj|const):`(~?)([^`]+)`")
LITERAL_MARKER = re.compile(r"(?<=\S)::$", flags=re.M)
LONE_MARKER = re.compile(r"^[ \t]*::\n", flags=re.M)


def _code_span(match: re.Match[str]) -> str:
    short, target = match.groups()
    return f"`{target.rsplit('.', 1)[-1] if short else target}`"


def to_markdown(text: str) -> str:
    """``text`` with RST roles as code spans and literal-block markers as plain colons."""
    text = ROLE.sub(_code_span, text)
    text = LONE_MARKER.sub("", text)
    return LITERAL_MARKER.sub(":", text)


class RstInlineMarkup(griffe.Extension):
    """Rewrite every docstring of the loaded packages with :func:`to_markdown`."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = to_markdown(obj.docstring.value)
