"""Chat histories: an immutable list of (role, content) messages that lives inside TensorDicts."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, overload

if TYPE_CHECKING:  # transformers is heavy; only needed for type hints here
    from transformers import PreTrainedTokenizerBase

ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True, slots=True)
class Message:
    """One chat message."""

    role: str
    content: str

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"Message role {self.role!r} is not one of {ROLES}; pick one of those.")
        if not isinstance(self.content, str):
            raise TypeError(f"Message content must be a str, got {type(self.content).__name__}.")


@dataclass(frozen=True, slots=True)
class History:
    """A dialog: an immutable tuple of messages, and the tools the model was offered (if any).

    It is stored in TensorDicts as non-tensor data, so a stack of histories of different
    lengths is just a stack of these objects (``td["history", "prompt"]`` gives a list).

    ``tools`` (OpenAI-style function definitions, JSON-able dicts) are handed to the chat
    template as its ``tools`` argument, so a template that renders them (Qwen's, Llama's) shows
    them to the model; every history derived from this one (:meth:`append`, slices) keeps them.
    """

    messages: tuple[Message, ...] = ()
    tools: tuple[dict[str, Any], ...] | None = field(default=None, hash=False)

    @classmethod
    def from_dicts(
        cls, messages: Iterable[Mapping[str, str]], *, tools: Sequence[Mapping[str, Any]] | None = None
    ) -> History:
        return cls(tuple(Message(m["role"], m["content"]) for m in messages), tools_of(tools))

    @classmethod
    def from_text(cls, text: str, *, system_prompt: str | None = None) -> History:
        """A one-question history: an optional system message, then ``text`` as the user."""
        msgs = [Message("system", system_prompt)] if system_prompt else []
        return cls((*msgs, Message("user", text)))

    def to_dicts(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.content} for m in self.messages]

    def append(self, role: str, content: str) -> History:
        return History((*self.messages, Message(role, content)), self.tools)

    def extend(self, other: History) -> History:
        return History(self.messages + other.messages, self.tools)

    def last(self, role: str | None = None) -> Message | None:
        """The last message, or the last one with ``role``."""
        for m in reversed(self.messages):
            if role is None or m.role == role:
                return m
        return None

    def apply_chat_template(
        self, tokenizer: PreTrainedTokenizerBase, *, add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render through the tokenizer's chat template (as text), with :attr:`tools` if there are any."""
        if self.tools is not None:
            kwargs.setdefault("tools", [dict(tool) for tool in self.tools])
        return tokenizer.apply_chat_template(
            self.to_dicts(), tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )

    def __len__(self) -> int:
        return len(self.messages)

    @overload
    def __getitem__(self, index: int) -> Message: ...
    @overload
    def __getitem__(self, index: slice) -> History: ...
    def __getitem__(self, index: int | slice) -> Message | History:
        if isinstance(index, slice):
            return History(self.messages[index], self.tools)
        return self.messages[index]


def tools_of(tools: Sequence[Mapping[str, Any]] | None) -> tuple[dict[str, Any], ...] | None:
    """``tools`` as a :class:`History` holds them: a tuple of plain dicts (None and ``[]``: no tools)."""
    if not tools:
        return None
    if isinstance(tools, (str, bytes, Mapping)) or not all(isinstance(tool, Mapping) for tool in tools):
        raise TypeError(f"tools must be a list of function definitions (dicts), got {tools!r:.200}.")
    return tuple(dict(tool) for tool in tools)
