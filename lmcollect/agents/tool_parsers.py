"""Tool calls in a model's text and back: the Hermes / Qwen ``<tool_call>{json}</tool_call>`` format, and the parser interface."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One function call the model wrote (OpenAI's ``tool_calls[i]``)."""

    id: str
    """The call's id (the agent answers it with a ``tool`` message naming it)."""
    name: str
    """The function's name."""
    arguments: str
    """Its arguments, a JSON object as text (OpenAI sends them as a string)."""

    def to_openai(self) -> dict[str, object]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True, slots=True)
class ParsedReply:
    """A model's reply split into text and tool calls."""

    content: str | None
    """The text outside the tool calls (None when there is none besides them)."""
    tool_calls: tuple[ToolCall, ...] = ()
    """The calls, in order."""
    error: str = ""
    """Why the reply's tool calls could not be read ("" when they could, or when there were none);
    the reply is then returned as plain text with no calls."""


@runtime_checkable
class ToolParser(Protocol):
    """Reads tool calls out of a model's text, and writes calls back as the model would have written them.

    ``parse`` never raises: a malformed call makes the whole reply plain text, with the reason in
    :attr:`ParsedReply.error`. ``render`` is used for assistant messages the agent sends that the
    model did not write in this dialog (the model's own replies keep their exact text).
    """

    def parse(self, text: str, *, call_id: Callable[[int], str]) -> ParsedReply:
        """``text`` split into content and calls; ``call_id(k)`` names the ``k``-th call."""
        ...

    def render(self, content: str | None, tool_calls: Sequence[ToolCall]) -> str:
        """The text a model writes for ``content`` followed by ``tool_calls``."""
        ...


@dataclass(frozen=True)
class HermesToolParser:
    """Hermes / Qwen 2.5+ tool calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block per call.

    What Qwen's and Hermes' chat templates teach their models and render tool calls as (vLLM's
    ``hermes`` parser reads the same). Every block must hold a JSON object with a string ``name``
    and an object ``arguments`` (a JSON string of an object is accepted too); an unclosed
    ``<tool_call>`` or a block that is not such an object makes the reply plain text with the error.
    """

    open_tag: str = "<tool_call>"
    """What opens a call."""
    close_tag: str = "</tool_call>"
    """What closes it."""
    _pattern: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.open_tag or not self.close_tag:
            raise ValueError("HermesToolParser needs a non-empty open_tag and close_tag, e.g. '<tool_call>'.")
        pattern = re.compile(f"{re.escape(self.open_tag)}(.*?){re.escape(self.close_tag)}", re.DOTALL)
        object.__setattr__(self, "_pattern", pattern)

    def parse(self, text: str, *, call_id: Callable[[int], str]) -> ParsedReply:
        if self.open_tag not in text:
            return ParsedReply(content=text)
        bodies = self._pattern.findall(text)
        if text.count(self.open_tag) != len(bodies):
            return ParsedReply(content=text, error=f"a {self.open_tag} is not closed by {self.close_tag}")
        calls = []
        for k, body in enumerate(bodies):
            call, error = _call_of(body, call_id(k))
            if call is None:
                return ParsedReply(content=text, error=f"tool call {k}: {error}")
            calls.append(call)
        content = self._pattern.sub("", text).strip()
        return ParsedReply(content=content or None, tool_calls=tuple(calls))

    def render(self, content: str | None, tool_calls: Sequence[ToolCall]) -> str:
        blocks = [
            f'{self.open_tag}\n{{"name": {json.dumps(call.name)}, "arguments": {_compact_arguments(call.arguments)}}}\n{self.close_tag}'
            for call in tool_calls
        ]
        return "\n".join(([content] if content else []) + blocks)


def _call_of(body: str, call_id: str) -> tuple[ToolCall | None, str]:
    """The call a block's JSON describes, or (None, why not)."""
    data, error = _loads(body)
    if error:
        return None, error
    if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not data["name"]:
        return None, 'expected {"name": "<function>", "arguments": {...}}'
    arguments = data.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        arguments, error = _loads(arguments)
        if error:
            return None, "arguments is a string that is not a JSON object"
    if not isinstance(arguments, dict):
        return None, f"arguments must be a JSON object, got {type(arguments).__name__}"
    text, error = _dumps(arguments)
    if error:
        return None, f"arguments {error}"
    return ToolCall(id=call_id, name=data["name"], arguments=text), ""


def _loads(text: str) -> tuple[Any, str]:
    """``json.loads(text)``, or (None, why not): text from a model or an agent may be malformed, nest
    deeper than the parser recurses or hold a number too long for ``int`` (none of which may raise)."""
    try:
        return json.loads(text), ""
    except json.JSONDecodeError as exc:
        return None, f"not JSON ({exc.msg} at character {exc.pos})"
    except RecursionError:
        return None, "JSON nested too deeply to read"
    except ValueError as exc:  # e.g. an integer of over 4300 digits
        return None, f"not readable JSON ({exc})"


def _dumps(value: Any) -> tuple[str, str]:
    """``value`` as compact JSON text, or ("", why not) (a value nested too deeply to write)."""
    try:
        return json.dumps(value, ensure_ascii=False), ""
    except (RecursionError, ValueError) as exc:
        return "", f"cannot be written back as JSON ({type(exc).__name__})"


def _compact_arguments(arguments: str) -> str:
    """The arguments as the model writes them: the JSON object itself (text that is no JSON, or JSON
    nested too deeply to rewrite, stays a string)."""
    value, error = _loads(arguments)
    text, error = ("", error) if error else _dumps(value)
    return text if not error else json.dumps(arguments)


TOOL_PARSERS: dict[str, Callable[[], ToolParser]] = {"hermes": HermesToolParser, "qwen": HermesToolParser}
"""The shipped tool-call formats by name (``AgentEnvConfig.tool_parser``)."""


def get_tool_parser(parser: str | ToolParser) -> ToolParser:
    """A parser by name (``"hermes"``, ``"qwen"``), or ``parser`` itself if it is one."""
    if isinstance(parser, str):
        if parser not in TOOL_PARSERS:
            raise ValueError(
                f"tool_parser={parser!r} is not a shipped format; use one of {sorted(TOOL_PARSERS)} or pass an "
                "object with parse(text, call_id=...) and render(content, tool_calls) (see ToolParser)."
            )
        return TOOL_PARSERS[parser]()
    if not isinstance(parser, ToolParser):
        raise TypeError(
            f"tool_parser must be a name in {sorted(TOOL_PARSERS)} or a ToolParser, got {type(parser).__name__}."
        )
    return parser
