"""Builds the per-turn TensorDict every policy backend returns (one layout for all)."""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any, NamedTuple

import torch
from tensordict import TensorDictBase, lazy_stack

from lmcollect.data import keys
from lmcollect.data.history import History
from lmcollect.data.turns import non_tensor_values
from lmcollect.engines.sampling import SamplingConfig
from lmcollect.policies.prompt_tokens import dialog_prompt_ids, tokenize_texts

__all__ = [
    "GenerateFn",
    "Generation",
    "answer_prompts",
    "generate_triples",
    "prompts_of",
    "stack_outputs",
    "tokenize_texts",
    "turn_of",
    "turn_output",
]


class Generation(NamedTuple):
    """One response generated from prompt token ids."""

    tokens: torch.Tensor
    """int64 ``[n]``: the generated ids, ending with the stop token if the response stopped there."""
    log_probs: torch.Tensor
    """float32 ``[n]``: raw log-probs (the model's softmax at temperature 1, before top-k / top-p)."""
    sampled_log_probs: torch.Tensor | None = None
    """float32 ``[n]``: log-probs under the distribution sampled, if ``SamplingConfig.sampled_log_probs``."""
    token_versions: torch.Tensor | None = None
    """int64 ``[n]``: the weight version of each token, from engines that record it (else the
    collector writes the turn's version for every token)."""
    kv_versions: torch.Tensor | None = None
    """int64 ``[n]``: the oldest version that computed a key/value each token attended to, from
    engines that report it (else the collector writes ``token_versions``)."""


# prompt token ids -> one Generation per prompt, in order
GenerateFn = Callable[[list[list[int]]], list[Generation]]


def turn_output(
    obs: TensorDictBase,
    *,
    prompt: History,
    prompt_text: str,
    response_text: str,
    prompt_tokens: torch.Tensor,
    response_tokens: torch.Tensor,
    log_probs: torch.Tensor,
) -> TensorDictBase:
    """One element's policy output: the observation's entries plus history/text/tokens/masks/log-probs."""
    full = prompt.append("assistant", response_text)
    num_prompt, num_response = prompt_tokens.numel(), response_tokens.numel()
    assistant_mask = torch.zeros(num_prompt + num_response, dtype=torch.bool)
    assistant_mask[num_prompt:] = True
    # the observation's entries (env ids, flags) travel with the turn; the carried prefix and the
    # requested sampling do not (the turn records the sampling used)
    out = obs.exclude(keys.HISTORY_PREFIX, keys.TOKENS_PREFIX, keys.SAMPLING_OVERRIDES)
    out.update(
        {
            "history": {"prompt": prompt, "response": History(full.messages[-1:]), "full": full},
            "text": {"prompt": prompt_text, "response": response_text, "full": prompt_text + response_text},
            "tokens": {
                "prompt": prompt_tokens,
                "response": response_tokens,
                "full": torch.cat([prompt_tokens, response_tokens]),
            },
            "masks": {
                "all_attention_mask": torch.ones(num_prompt + num_response, dtype=torch.bool),
                "all_assistant_mask": assistant_mask,
            },
            "log_probs": {"response": log_probs},
        }
    )
    return out


def record_sampling(out: TensorDictBase, sampling: SamplingConfig, sampled_log_probs: torch.Tensor | None) -> None:
    """Write the turn's sampling parameters (``keys.SAMPLING_*``) and, if kept, its sampled log-probs."""
    if sampling.sampled_log_probs != (sampled_log_probs is not None):
        raise ValueError(
            f"sampling.sampled_log_probs={sampling.sampled_log_probs} but the engine "
            f"{'returned no' if sampled_log_probs is None else 'returned'} sampled log-probs."
        )
    out.set(keys.SAMPLING_TEMPERATURE, torch.tensor(sampling.temperature, dtype=torch.float32))
    out.set(keys.SAMPLING_TOP_P, torch.tensor(sampling.top_p, dtype=torch.float32))
    out.set(keys.SAMPLING_TOP_K, torch.tensor(sampling.top_k, dtype=torch.int64))
    out.set(keys.SAMPLING_MAX_NEW_TOKENS, torch.tensor(sampling.max_new_tokens, dtype=torch.int64))
    out.set(keys.SAMPLING_SAMPLED_LOG_PROBS, torch.tensor(sampling.sampled_log_probs))
    if sampled_log_probs is not None:
        out.set(keys.LOG_PROBS_SAMPLED, sampled_log_probs)


def record_token_versions(
    out: TensorDictBase, token_versions: torch.Tensor | None, kv_versions: torch.Tensor | None = None
) -> None:
    """Write ``("collector", "token_versions")`` (and ``"kv_versions"``) as an engine reported them: an
    engine that never got a push (-1) holds the initial weights, version 0. The collector fills the
    keys for policies that report none, and writes -1 everywhere when it does not track versions."""
    if token_versions is not None:
        out.set(keys.TOKEN_VERSIONS, token_versions.to(torch.int64).clamp(min=0))
    if kv_versions is None:
        kv_versions = token_versions  # an engine that reports none recomputes: each token's own version
    if kv_versions is not None:
        out.set(keys.KV_VERSIONS, kv_versions.to(torch.int64).clamp(min=0))


def prompts_of(td: TensorDictBase) -> list[History]:
    """The ``("history", "prompt")`` of every element, with a clear error if missing."""
    if keys.HISTORY_PROMPT not in td.keys(include_nested=True):
        raise KeyError(
            f"the policy input has no {keys.HISTORY_PROMPT} entry; the env's reset/step must provide it "
            "(see lmcollect.envs.protocol.EnvProtocol)."
        )
    return non_tensor_values(td, keys.HISTORY_PROMPT)


def stack_outputs(outputs: list[TensorDictBase]) -> TensorDictBase:
    return lazy_stack(outputs)


def answer_prompts(
    td: TensorDictBase,
    tokenizer: Any,
    generate: GenerateFn,
    *,
    sampling: SamplingConfig,
    stop_token_ids: Collection[int],
) -> TensorDictBase:
    """The body of every tokenizer-based policy: prompt token ids, generate, decode, one turn output per element.

    An element carrying the previous turn's tokens and history (``keys.TOKENS_PREFIX`` /
    ``keys.HISTORY_PREFIX``, put there by the collector) whose prompt extends that history gets
    those tokens, exactly as generated, followed by the tokens of the new messages (see
    :mod:`lmcollect.policies.prompt_tokens`); any other element (first turns, single-turn or custom
    envs) gets its history rendered with the chat template and tokenized. The tokens are the truth
    a trainer should use; ``text`` entries are the chat template's rendering of the history and may
    differ from the decoded tokens (e.g. after a reply cut by ``max_new_tokens``, which the tokens
    keep without an end token).
    """
    prompts = prompts_of(td)
    elements = [td[i] for i in range(len(prompts))] if td.batch_dims else [td]
    texts = [p.apply_chat_template(tokenizer) for p in prompts]
    prompt_ids = dialog_prompt_ids(elements, prompts, texts, tokenizer, stop_token_ids)
    generations = generate(prompt_ids)
    return stack_outputs([
        turn_of(element, prompt=prompt, prompt_text=text, prompt_ids=ids, generation=generation, tokenizer=tokenizer, sampling=sampling)
        for element, prompt, text, ids, generation in zip(elements, prompts, texts, prompt_ids, generations, strict=True)
    ])  # fmt: skip


def turn_of(
    obs: TensorDictBase,
    *,
    prompt: History,
    prompt_text: str,
    prompt_ids: list[int],
    generation: Generation,
    tokenizer: Any,
    sampling: SamplingConfig,
) -> TensorDictBase:
    """The one turn builder: one element's turn from its prompt and its generation, under either
    scheduler (a lockstep batch through :func:`answer_prompts`, a continuous collector per request).

    The observation's entries, the history / text / tokens / masks / log-probs
    (:func:`turn_output`), the sampling record and, from engines that report it, each token's
    weight version. A generation whose tokens, log-probs and versions differ in length is refused.
    """
    num_tokens = generation.tokens.numel()
    lengths = [
        t.numel()
        for t in (generation.log_probs, generation.sampled_log_probs, generation.token_versions, generation.kv_versions)
        if t is not None
    ]
    if any(n != num_tokens for n in lengths):
        raise ValueError(
            f"the engine returned {num_tokens} tokens but {lengths} log-probs / versions; it must return one of each per token."
        )
    out = turn_output(
        obs,
        prompt=prompt,
        prompt_text=prompt_text,
        response_text=tokenizer.decode(generation.tokens, skip_special_tokens=True),
        prompt_tokens=torch.tensor(prompt_ids, dtype=torch.long),
        response_tokens=generation.tokens.to(torch.int64),
        log_probs=generation.log_probs.to(torch.float32),
    )
    record_sampling(out, sampling, generation.sampled_log_probs)
    record_token_versions(out, generation.token_versions, generation.kv_versions)
    return out


def generate_triples(
    tokenizer: Any, generate: GenerateFn, prompts: Any
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """The ``generate(prompts)`` of every tokenizer-based policy: prompt tokens, response tokens and
    raw response log-probs per prompt. ``prompts`` are token-id lists; strings are tokenized (no
    special tokens added) for callers that render prompts themselves."""
    prompt_ids = tokenize_texts(tokenizer, prompts)
    generations = generate(prompt_ids)
    prompt_tensors = [torch.tensor(ids, dtype=torch.long) for ids in prompt_ids]
    return prompt_tensors, [g.tokens for g in generations], [g.log_probs for g in generations]
