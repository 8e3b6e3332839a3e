"""One dialog turn through an engine: token-exact prompt ids, the request, and the turn from its result.

The same pieces as :func:`lmcollect.policies.outputs.answer_prompts` (prompt ids extended from the
previous turn's tokens, :func:`~lmcollect.policies.outputs.turn_output`, the sampling record), for
one element at a time, so a continuous turn has exactly the layout of a synchronous one, plus
``("collector", "token_versions")``.
"""
from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import torch
from tensordict import TensorDictBase

from lmcollect.data.history import History
from lmcollect.engines.protocol import EngineRequest, EngineResult
from lmcollect.policies.outputs import prompts_of, record_sampling, record_token_versions, turn_output
from lmcollect.policies.prompt_tokens import dialog_prompt_ids
from lmcollect.engines.sampling import SamplingConfig


@dataclass(frozen=True)
class TurnPrompt:
    """What the engine is asked for one turn."""

    history: History
    text: str
    ids: list[int]


def prompt_of(obs: TensorDictBase, tokenizer: Any, stop_token_ids: Collection[int]) -> TurnPrompt:
    """The prompt of one observation (empty batch size): the dialog's tokens so far + the new messages."""
    history = prompts_of(obs)[0]
    text = history.apply_chat_template(tokenizer)
    ids = dialog_prompt_ids([obs], [history], [text], tokenizer, stop_token_ids)[0]
    return TurnPrompt(history, text, ids)


def request_of(
    prompt: TurnPrompt, *, sampling: SamplingConfig, stop_token_ids: Collection[int], request_id: str, affinity: str
) -> EngineRequest:
    return EngineRequest(
        prompt_ids=prompt.ids,
        sampling=sampling,
        stop_token_ids=tuple(stop_token_ids),
        request_id=request_id,
        affinity=affinity,
    )


def turn_from_result(
    obs: TensorDictBase, prompt: TurnPrompt, result: EngineResult, *, tokenizer: Any, sampling: SamplingConfig
) -> TensorDictBase:
    """The turn TensorDict, as :func:`~lmcollect.policies.outputs.answer_prompts` builds it for a
    lockstep policy, with the engine's ``("collector", "token_versions")``."""
    num_tokens, num_log_probs = result.tokens.numel(), result.log_probs.numel()
    if num_log_probs != num_tokens or result.token_versions.numel() != num_tokens:
        raise ValueError(
            f"engine returned {num_tokens} tokens, {num_log_probs} log-probs and "
            f"{result.token_versions.numel()} token versions; it must return one of each per token."
        )
    out = turn_output(
        obs,
        prompt=prompt.history,
        prompt_text=prompt.text,
        response_text=tokenizer.decode(result.tokens, skip_special_tokens=True),
        prompt_tokens=torch.tensor(prompt.ids, dtype=torch.long),
        response_tokens=result.tokens.to(torch.int64),
        log_probs=result.log_probs.to(torch.float32),
    )
    record_sampling(out, sampling, result.sampled_log_probs if sampling.sampled_log_probs else None)
    record_token_versions(out, result.token_versions)
    return out
