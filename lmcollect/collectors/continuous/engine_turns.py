"""One dialog turn through an engine: token-exact prompt ids, the request, and the turn from its result.

The same pieces as :func:`lmcollect.policies.outputs.answer_prompts` (prompt ids extended from the
previous turn's tokens, the one turn builder :func:`~lmcollect.policies.outputs.turn_of`), for one
element at a time, so a continuous turn has exactly the layout of a lockstep one.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from tensordict import NonTensorData, TensorDictBase

from lmcollect.data import keys
from lmcollect.data.history import History
from lmcollect.engines.protocol import EngineRequest, EngineResult
from lmcollect.engines.sampling import SamplingConfig
from lmcollect.policies.outputs import Generation, prompts_of, turn_of
from lmcollect.policies.prompt_tokens import dialog_prompt_ids, tokenize_texts

OVERRIDABLE = frozenset({"max_new_tokens", "temperature", "top_p", "stop_strings"})
"""The sampling fields an observation may set for its own turn (``keys.SAMPLING_OVERRIDES``)."""


@dataclass(frozen=True)
class TurnPrompt:
    """What the engine is asked for one turn."""

    history: History
    text: str
    ids: list[int]
    prefix_mismatch: bool = False
    """The ids reuse the dialog's recorded tokens and the chat template tokenizes ``text`` otherwise."""


def prompt_of(obs: TensorDictBase, tokenizer: Any, stop_token_ids: Collection[int]) -> TurnPrompt:
    """The prompt of one observation (empty batch size): the dialog's tokens so far + the new messages.

    When the ids start with the recorded tokens the observation carries (``keys.TOKENS_PREFIX``),
    they are compared with the chat template's own tokenization of ``text``: a difference is a
    prefix mismatch (the turn keeps the recorded tokens, which are what the model saw).
    """
    history = prompts_of(obs)[0]
    text = history.apply_chat_template(tokenizer)
    ids = dialog_prompt_ids([obs], [history], [text], tokenizer, stop_token_ids)[0]
    prefix = obs.get(keys.TOKENS_PREFIX, None)
    reused = isinstance(prefix, torch.Tensor) and 0 < prefix.numel() <= len(ids)
    mismatch = reused and ids[: prefix.numel()] == prefix.tolist() and tokenize_texts(tokenizer, [text])[0] != ids
    return TurnPrompt(history, text, ids, prefix_mismatch=bool(mismatch))


def sampling_of(obs: TensorDictBase, sampling: SamplingConfig) -> SamplingConfig:
    """The sampling of one turn: ``sampling``, with the observation's ``keys.SAMPLING_OVERRIDES`` (a dict,
    or its JSON text) applied.

    ``temperature`` and ``top_p`` replace the collector's; ``max_new_tokens`` may only lower its
    budget; ``stop_strings`` add to its stop strings. Other fields are refused (ValueError).
    """
    overrides = obs.get(keys.SAMPLING_OVERRIDES, None)
    if overrides is None:
        return sampling
    overrides = overrides.data if isinstance(overrides, NonTensorData) else overrides
    if isinstance(overrides, str):  # JSON text: what an env stores (a str survives stacks and checkpoints as it is)
        overrides = json.loads(overrides)
    if not isinstance(overrides, Mapping) or not set(overrides) <= OVERRIDABLE:
        raise ValueError(
            f"{keys.SAMPLING_OVERRIDES} must be a dict with keys among {sorted(OVERRIDABLE)}, got {overrides!r}."
        )
    changes = dict(overrides)
    if "max_new_tokens" in changes:
        changes["max_new_tokens"] = min(int(changes["max_new_tokens"]), sampling.max_new_tokens)
        if changes["max_new_tokens"] < sampling.min_new_tokens:
            raise ValueError(
                f"the turn asks for max_tokens={changes['max_new_tokens']}, below the collector's "
                f"min_new_tokens={sampling.min_new_tokens}; ask for max_tokens >= {sampling.min_new_tokens} "
                "or lower SamplingConfig.min_new_tokens."
            )
    if "stop_strings" in changes:
        changes["stop_strings"] = (*sampling.stop_strings, *changes["stop_strings"])
    return dataclasses.replace(sampling, **changes) if changes else sampling


def request_of(
    prompt: TurnPrompt,
    *,
    sampling: SamplingConfig,
    stop_token_ids: Collection[int],
    request_id: str,
    affinity: str,
    context_kv_version: int | None = None,
) -> EngineRequest:
    return EngineRequest(
        prompt_ids=prompt.ids,
        sampling=sampling,
        stop_token_ids=tuple(stop_token_ids),
        request_id=request_id,
        affinity=affinity,
        context_kv_version=context_kv_version,
    )


def turn_from_result(
    obs: TensorDictBase, prompt: TurnPrompt, result: EngineResult, *, tokenizer: Any, sampling: SamplingConfig
) -> TensorDictBase:
    """The turn of one request, built by the lockstep policies' own :func:`~lmcollect.policies.outputs.turn_of`,
    plus ``keys.PREFIX_MISMATCH``."""
    generation = Generation(
        result.tokens,
        result.log_probs,
        result.sampled_log_probs if sampling.sampled_log_probs else None,
        result.token_versions,
        result.kv_versions,
    )
    turn = turn_of(
        obs, prompt=prompt.history, prompt_text=prompt.text, prompt_ids=prompt.ids, generation=generation,
        tokenizer=tokenizer, sampling=sampling,
    )  # fmt: skip
    turn.set(keys.PREFIX_MISMATCH, torch.tensor(prompt.prefix_mismatch))
    return turn
