"""One dialog turn through an engine: token-exact prompt ids, the request, and the turn from its result.

The same pieces as :func:`lmcollect.policies.outputs.answer_prompts` (prompt ids extended from the
previous turn's tokens, the one turn builder :func:`~lmcollect.policies.outputs.turn_of`), for one
element at a time, so a continuous turn has exactly the layout of a lockstep one.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from tensordict import TensorDictBase

from lmcollect.data.history import History
from lmcollect.engines.protocol import EngineRequest, EngineResult
from lmcollect.engines.sampling import SamplingConfig
from lmcollect.policies.outputs import Generation, prompts_of, turn_of
from lmcollect.policies.prompt_tokens import dialog_prompt_ids


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
    """The turn of one request, built by the lockstep policies' own :func:`~lmcollect.policies.outputs.turn_of`."""
    generation = Generation(
        result.tokens,
        result.log_probs,
        result.sampled_log_probs if sampling.sampled_log_probs else None,
        result.token_versions,
        result.kv_versions,
    )
    return turn_of(
        obs, prompt=prompt.history, prompt_text=prompt.text, prompt_ids=prompt.ids, generation=generation,
        tokenizer=tokenizer, sampling=sampling,
    )  # fmt: skip
