"""Prompt token ids of a dialog turn: the dialog's tokens so far, exactly as generated, plus the new messages.

Re-tokenizing a dialog's decoded text drifts from what the engine saw (a token sequence decodes
and re-encodes differently, a reply cut by ``max_new_tokens`` gains an end token it never
emitted). So when the collector carries the previous turn's tokens (``keys.TOKENS_PREFIX``) and
history (``keys.HISTORY_PREFIX``) into the observation, the next prompt is built by appending:

    prompt tokens = previous tokens.full + tokenize(closing + new messages + generation prompt)

``closing`` is what the chat template writes after the assistant's content once that content
ended with a stop token (ChatML: the ``"\\n"`` after ``<|im_end|>``; the whole closing text if the
stop token is not the template's end text), and nothing for a truncated reply. The new part is
the rendering of the longer history (with the generation prompt) past the rendering of the
previous one. Templates that do not render a history as a prefix of its extension (e.g. ones that
drop earlier reasoning) fall back to rendering the whole dialog, with one warning.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from typing import Any

import torch
from tensordict import NonTensorData, TensorDictBase

from lmcollect.data import keys
from lmcollect.data.history import History

logger = logging.getLogger(__name__)
_warned_templates: set[str] = set()


def tokenize_texts(tokenizer: Any, prompts: Sequence[Sequence[int]] | Sequence[str]) -> list[list[int]]:
    """Token-id lists as they are; strings tokenized without added special tokens (one batched call)."""
    items: list[Sequence[int] | str] = list(prompts)
    texts = [i for i, p in enumerate(items) if isinstance(p, str)]
    ids = [list(p) if not isinstance(p, str) else [] for p in items]
    if texts:
        encoded = tokenizer([items[i] for i in texts], add_special_tokens=False)["input_ids"]
        for i, tokens in zip(texts, encoded, strict=True):
            ids[i] = list(tokens)
    return ids


def dialog_prompt_ids(
    elements: Sequence[TensorDictBase],
    prompts: Sequence[History],
    texts: Sequence[str],
    tokenizer: Any,
    stop_token_ids: Collection[int],
) -> list[list[int]]:
    """Prompt token ids of each element: its prefix extended (see the module docstring), or ``texts[i]`` tokenized."""
    ids: list[list[int] | None] = []
    for element, prompt in zip(elements, prompts, strict=True):
        prefix = _prefix_of(element)
        ids.append(None if prefix is None else extend_prefix(tokenizer, prompt, *prefix, stop_token_ids))
    missing = [i for i, tokens in enumerate(ids) if tokens is None]
    rendered = dict(zip(missing, tokenize_texts(tokenizer, [texts[i] for i in missing]), strict=True))
    return [tokens if tokens is not None else rendered[i] for i, tokens in enumerate(ids)]


def extend_prefix(
    tokenizer: Any,
    prompt: History,
    prefix_history: History,
    prefix_tokens: torch.Tensor,
    stop_token_ids: Collection[int],
) -> list[int] | None:
    """``prefix_tokens`` + the tokens of what ``prompt`` adds to ``prefix_history``.

    None when ``prompt`` does not extend ``prefix_history`` (the env rewrote the dialog) or the
    chat template does not render one as a prefix of the other; the caller then renders ``prompt``.
    """
    num_prefix = len(prefix_history)
    if num_prefix == 0 or prefix_tokens.numel() == 0 or prompt.messages[:num_prefix] != prefix_history.messages:
        return None
    last = prefix_history.messages[-1]
    if last.role != "assistant":
        return None
    ended = int(prefix_tokens[-1]) in stop_token_ids
    end_text = tokenizer.decode([int(prefix_tokens[-1])]) if ended else ""
    suffix = _suffix_text(tokenizer, prompt, prefix_history, end_text=end_text, ended=ended)
    if suffix is None:
        _warn_fallback(tokenizer)
        return None
    return prefix_tokens.tolist() + tokenizer(suffix, add_special_tokens=False)["input_ids"]


def _suffix_text(tokenizer: Any, prompt: History, prefix: History, *, end_text: str, ended: bool) -> str | None:
    """The text the template adds after the last assistant content, or None if it is not a clean prefix."""
    opened = prefix[:-1].apply_chat_template(tokenizer, add_generation_prompt=True)
    closed = prefix.apply_chat_template(tokenizer, add_generation_prompt=False)
    content = prefix.messages[-1].content
    if not closed.startswith(opened + content):
        return None
    longer = prompt.apply_chat_template(tokenizer, add_generation_prompt=True)
    if not longer.startswith(closed):
        return None
    closing = closed[len(opened) + len(content) :]
    if not ended:
        closing = ""  # a truncated reply stays cut: no end token it never wrote
    elif end_text and closing.startswith(end_text):
        closing = closing[len(end_text) :]  # the stop token the model wrote is already in the prefix
    return closing + longer[len(closed) :]


def _prefix_of(element: TensorDictBase) -> tuple[History, torch.Tensor] | None:
    tokens = element.get(keys.TOKENS_PREFIX, None)
    history = element.get(keys.HISTORY_PREFIX, None)
    if tokens is None or history is None:
        return None
    history = history.data if isinstance(history, NonTensorData) else history
    if not isinstance(history, History) or not isinstance(tokens, torch.Tensor):
        raise TypeError(
            f"{keys.HISTORY_PREFIX} must hold a History and {keys.TOKENS_PREFIX} a tensor of token ids, got "
            f"{type(history).__name__} and {type(tokens).__name__}."
        )
    return history, tokens


def _warn_fallback(tokenizer: Any) -> None:
    name = str(getattr(tokenizer, "name_or_path", "")) or type(tokenizer).__name__
    if name not in _warned_templates:
        _warned_templates.add(name)
        logger.warning(
            "the chat template of %s does not render a dialog as a prefix of its continuation; next-turn "
            "prompts are re-tokenized from the rendered history, so they may not start with the previous "
            "turn's tokens exactly.",
            name,
        )
