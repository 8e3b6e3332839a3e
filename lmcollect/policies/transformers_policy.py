"""A policy that generates with a Hugging Face transformers causal LM."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from tensordict import TensorDictBase

from lmcollect.policies.outputs import answer_prompts
from lmcollect.policies.sampling import SamplingConfig

if TYPE_CHECKING:  # transformers is imported by the caller who built the model
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


class TransformersPolicy:
    """Answers a batch of chat prompts with ``model.generate`` (left padding, one call per batch).

    Log-probs are those of the raw model (before temperature / top-p / top-k), so they equal a
    plain forward pass on the same tokens, as trainers need for importance ratios.

    Args:
        model: a causal LM; exposed as ``.model`` for weight updates.
        tokenizer: its tokenizer, with a chat template and pad/eos tokens.
        sampling: sampling parameters; keyword arguments override its fields.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        sampling: SamplingConfig | None = None,
        **sampling_kwargs: Any,
    ) -> None:
        if tokenizer.pad_token_id is None:
            raise ValueError("the tokenizer has no pad token; set tokenizer.pad_token before building the policy.")
        if sampling_kwargs:
            base = vars(sampling) if sampling is not None else {}
            sampling = SamplingConfig(**{**base, **sampling_kwargs})
        self.sampling = sampling or SamplingConfig()
        self.model = model.eval()
        self.tokenizer = tokenizer
        self._eos_ids = self._eos_token_ids()
        if self.sampling.seed is not None:
            self.set_seed(self.sampling.seed)

    def _eos_token_ids(self) -> list[int]:
        ids = self.model.generation_config.eos_token_id
        ids = [ids] if isinstance(ids, int) else list(ids or [])
        if self.tokenizer.eos_token_id is not None and self.tokenizer.eos_token_id not in ids:
            ids.append(self.tokenizer.eos_token_id)
        if not ids:
            raise ValueError("neither the model's generation_config nor the tokenizer defines an eos token.")
        return ids

    def set_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def _generate_kwargs(self) -> dict[str, Any]:
        s = self.sampling
        kwargs: dict[str, Any] = {
            "max_new_tokens": s.max_new_tokens,
            "do_sample": not s.greedy,
            "pad_token_id": self.tokenizer.pad_token_id,
            "eos_token_id": self._eos_ids,
            "return_dict_in_generate": True,
            "output_logits": True,
        }
        if s.ignore_eos:
            kwargs["min_new_tokens"] = s.max_new_tokens
        if not s.greedy:
            kwargs.update(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k)
        else:  # the model's generation_config may carry sampling defaults; greedy ignores them
            kwargs.update(temperature=None, top_p=None, top_k=None)
        return kwargs

    @torch.inference_mode()
    def generate(self, prompt_texts: list[str]) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """Prompt tokens, response tokens and response log-probs for each prompt text."""
        enc = self.tokenizer(
            prompt_texts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False
        )
        device = self.model.device
        input_ids, attention = enc["input_ids"].to(device), enc["attention_mask"].to(device)
        out = self.model.generate(input_ids=input_ids, attention_mask=attention, **self._generate_kwargs())
        generated = out.sequences[:, input_ids.shape[1] :]
        logits = torch.stack(out.logits, dim=1).float()
        log_probs = logits.log_softmax(-1).gather(-1, generated.unsqueeze(-1)).squeeze(-1)
        lengths = self._response_lengths(generated)
        prompts = [ids[mask.bool()].cpu() for ids, mask in zip(input_ids, attention)]
        responses = [generated[i, :n].cpu() for i, n in enumerate(lengths)]
        response_log_probs = [log_probs[i, :n].cpu() for i, n in enumerate(lengths)]
        return prompts, responses, response_log_probs

    def _response_lengths(self, generated: torch.Tensor) -> list[int]:
        # A row ends at its first eos (kept); later positions are padding. Tokens equal to the
        # pad id before the eos are real output, so we never strip by pad id.
        is_eos = torch.isin(generated, torch.tensor(self._eos_ids, device=generated.device))
        has_eos = is_eos.any(dim=1)
        first_eos = is_eos.int().argmax(dim=1)
        lengths = torch.where(has_eos, first_eos + 1, generated.shape[1])
        return lengths.tolist()

    def __call__(self, td: TensorDictBase) -> TensorDictBase:
        return answer_prompts(td, self.tokenizer, self.generate)
