"""Builds the per-turn TensorDict every policy backend returns (one layout for all)."""
from __future__ import annotations

from typing import Any, Callable

import torch
from tensordict import TensorDictBase, lazy_stack

from lmcollect.data import keys
from lmcollect.data.history import History
from lmcollect.data.turns import non_tensor_values


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
    # the observation's entries (env ids, flags) travel with the turn; the carried prefix does not
    out = obs.exclude(keys.HISTORY_PREFIX, keys.TOKENS_PREFIX)
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


# prompt texts -> (prompt tokens, response tokens, response log-probs), one entry per prompt
GenerateFn = Callable[[list[str]], tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]]


def answer_prompts(td: TensorDictBase, tokenizer: Any, generate: GenerateFn) -> TensorDictBase:
    """The body of every tokenizer-based policy: render each prompt with the chat template,
    generate, decode, and build one turn output per element (a lazy stack)."""
    prompts = prompts_of(td)
    texts = [p.apply_chat_template(tokenizer) for p in prompts]
    prompt_tokens, response_tokens, log_probs = generate(texts)
    outputs = []
    for i, prompt in enumerate(prompts):
        outputs.append(
            turn_output(
                td[i] if td.batch_dims else td,
                prompt=prompt,
                prompt_text=texts[i],
                response_text=tokenizer.decode(response_tokens[i], skip_special_tokens=True),
                prompt_tokens=prompt_tokens[i],
                response_tokens=response_tokens[i],
                log_probs=log_probs[i],
            )
        )
    return stack_outputs(outputs)
