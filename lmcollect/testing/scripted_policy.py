"""A deterministic scripted policy for tests and examples: no model, known answers."""
from __future__ import annotations

from typing import Callable

import torch
from tensordict import TensorDictBase

from lmcollect.data.history import History
from lmcollect.policies.outputs import prompts_of, stack_outputs, turn_output


class ScriptedPolicy:
    """Answers each prompt with ``respond(history)``; tokens are the UTF-8 bytes of the text.

    Log-probs are all zero (the answer is certain). Use it to test envs and collectors where a
    real model's randomness would hide bookkeeping bugs.
    """

    def __init__(self, respond: Callable[[History], str] | str = "ok") -> None:
        self.respond = (lambda _h: respond) if isinstance(respond, str) else respond
        self.num_calls = 0

    @staticmethod
    def _render(history: History) -> str:
        return "".join(f"<{m.role}>{m.content}\n" for m in history.messages) + "<assistant>"

    @staticmethod
    def _bytes(text: str) -> torch.Tensor:
        return torch.tensor(list(text.encode("utf-8")), dtype=torch.int64)

    def __call__(self, td: TensorDictBase) -> TensorDictBase:
        self.num_calls += 1
        outputs = []
        for i, prompt in enumerate(prompts_of(td)):
            prompt_text, response_text = self._render(prompt), self.respond(prompt)
            response_tokens = self._bytes(response_text)
            outputs.append(
                turn_output(
                    td[i] if td.batch_dims else td,
                    prompt=prompt,
                    prompt_text=prompt_text,
                    response_text=response_text,
                    prompt_tokens=self._bytes(prompt_text),
                    response_tokens=response_tokens,
                    log_probs=torch.zeros(response_tokens.numel()),
                )
            )
        return stack_outputs(outputs)
