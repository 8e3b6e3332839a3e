"""A policy that generates with a Hugging Face transformers causal LM."""
from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any

import torch
from tensordict import TensorDictBase
from transformers import StoppingCriteria, StoppingCriteriaList

from lmcollect.policies.outputs import Generation, answer_prompts, generate_triples
from lmcollect.engines.running_request import StopStringWatch
from lmcollect.engines.sampling import SamplingConfig, eos_token_ids, sampling_from_kwargs
from lmcollect.engines.step_log_probs import StepLogProbs, no_generate_warpers

if TYPE_CHECKING:  # transformers is imported by the caller who built the model
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


class TransformersPolicy:
    """Answers a batch of chat prompts with ``model.generate`` (left padding, one call per batch).

    Prompts go in as token ids (see :func:`lmcollect.policies.outputs.answer_prompts`): in a
    multi-turn dialog the next prompt starts with the previous turn's tokens exactly as generated.
    The tokens are the truth; ``text`` entries are a rendering of the history.

    Log-probs are those of the raw model (before temperature / top-p / top-k), so they equal a
    plain forward pass on the same tokens, as trainers need for importance ratios. They are
    gathered one decoding step at a time (:class:`~lmcollect.engines.step_log_probs.StepLogProbs`),
    so memory does not grow with batch x length x vocabulary. With
    ``SamplingConfig(sampled_log_probs=True)`` the log-probs of the distribution actually sampled
    are stored too, under ``("log_probs", "sampled")``.

    Generation options (keywords or :class:`SamplingConfig` fields): ``max_new_tokens``,
    ``temperature`` (0 = greedy), ``top_p``, ``top_k``, ``min_new_tokens``, ``ignore_eos``,
    ``repetition_penalty``, ``stop_strings``, ``seed``, ``sampled_log_probs``, and ``do_sample``
    (False = greedy). None for temperature / top_p / top_k / min_new_tokens / repetition_penalty /
    stop_strings means off, as in ``generate``; other ``generate`` keywords are refused with a
    TypeError listing these. The raw log-probs stay those of the model whatever the options.

    Args:
        model: a causal LM; exposed as ``.model`` for weight updates.
        tokenizer: its tokenizer, with a chat template and pad/eos tokens.
        sampling: sampling parameters; keyword arguments override its fields.
        stop_token_ids: more ids that end a response (kept as its last token), on top of the
            model's eos ids; e.g. to give a random model responses of varied length.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        sampling: SamplingConfig | None = None,
        stop_token_ids: Collection[int] | None = None,
        **sampling_kwargs: Any,
    ) -> None:
        if tokenizer.pad_token_id is None:
            raise ValueError("the tokenizer has no pad token; set tokenizer.pad_token before building the policy.")
        self.sampling = sampling_from_kwargs(sampling, sampling_kwargs, owner="TransformersPolicy")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self._eos_ids = self._eos_token_ids()
        # ids that end a response: eos and the extra ones (ignore_eos masks only eos, as vLLM does)
        self._stop_ids = self._eos_ids + [int(i) for i in stop_token_ids or () if int(i) not in self._eos_ids]
        if self.sampling.seed is not None:
            self.set_seed(self.sampling.seed)

    def _eos_token_ids(self) -> list[int]:
        ids = eos_token_ids(self.model.generation_config.eos_token_id, self.tokenizer)
        if not ids:
            raise ValueError("neither the model's generation_config nor the tokenizer defines an eos token.")
        return ids

    @property
    def stop_token_ids(self) -> list[int]:
        """Token ids that end a response (kept as its last token)."""
        return list(self._stop_ids)

    def set_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def _generate_kwargs(self) -> dict[str, Any]:
        # eos stays a stopping token under ignore_eos: StepLogProbs masks it, so it is never drawn.
        # min_new_tokens and repetition_penalty are generate's own processors, which run before
        # StepLogProbs' (so sampled log-probs see them); explicit values override a model's
        # generation_config (None drops its processor).
        sampling = self.sampling
        return {
            "max_new_tokens": sampling.max_new_tokens,
            "min_new_tokens": sampling.min_new_tokens or None,
            "repetition_penalty": sampling.repetition_penalty if sampling.repetition_penalty != 1.0 else None,
            "do_sample": not sampling.greedy,
            "pad_token_id": self.tokenizer.pad_token_id,
            "eos_token_id": self._stop_ids,
            **no_generate_warpers(sampling),
        }

    def generate(
        self, prompts: Sequence[Sequence[int]] | Sequence[str]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """Prompt tokens, response tokens and raw response log-probs for each prompt (token-id
        lists, or strings tokenized without special tokens)."""
        return generate_triples(self.tokenizer, self.generate_responses, prompts)

    @torch.inference_mode()
    def generate_responses(self, prompt_ids: list[list[int]]) -> list[Generation]:
        """One response per prompt (token ids), in order; prompts are left-padded here."""
        input_ids, attention = self._left_pad(prompt_ids)
        steps = StepLogProbs(self.sampling, self._eos_ids)
        stop = StopStrings(self.tokenizer, self.sampling, prompt_width=input_ids.shape[1])
        with steps.attached(self.model):
            sequences = self.model.generate(
                input_ids=input_ids,
                attention_mask=attention,
                logits_processor=steps.processor,
                stopping_criteria=StoppingCriteriaList([*steps.criterion, stop]),
                **self._generate_kwargs(),
            )
        generated = sequences[:, input_ids.shape[1] :]
        log_probs, sampled = steps.log_probs(generated.shape[1])
        generations = []
        for i, n in enumerate(self._response_lengths(generated, stop.lengths)):
            generations.append(
                Generation(
                    tokens=generated[i, :n].cpu(),
                    log_probs=log_probs[i, :n].cpu(),
                    sampled_log_probs=None if sampled is None else sampled[i, :n].cpu(),
                )
            )
        return generations

    def _left_pad(self, prompt_ids: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        if not prompt_ids or any(len(ids) == 0 for ids in prompt_ids):
            raise ValueError("every prompt needs at least one token; got an empty prompt or no prompts.")
        width = max(len(ids) for ids in prompt_ids)
        input_ids = torch.full((len(prompt_ids), width), self.tokenizer.pad_token_id, dtype=torch.long)
        attention = torch.zeros((len(prompt_ids), width), dtype=torch.long)
        for row, ids in enumerate(prompt_ids):
            input_ids[row, width - len(ids) :] = torch.as_tensor(ids, dtype=torch.long)
            attention[row, width - len(ids) :] = 1
        device = self.model.device
        return input_ids.to(device), attention.to(device)

    def _response_lengths(self, generated: torch.Tensor, stop_lengths: Sequence[int] = ()) -> list[int]:
        # A row ends at its first eos (kept) or at the token completing a stop string (kept), if
        # sooner; later positions are padding. Tokens equal to the pad id before the end are real
        # output, so we never strip by pad id.
        is_eos = torch.isin(generated, torch.tensor(self._stop_ids, device=generated.device))
        has_eos = is_eos.any(dim=1)
        first_eos = is_eos.int().argmax(dim=1)
        lengths = torch.where(has_eos, first_eos + 1, generated.shape[1]).tolist()
        return [min(n, stop) for n, stop in zip(lengths, stop_lengths or lengths)]

    def __call__(self, td: TensorDictBase) -> TensorDictBase:
        return answer_prompts(
            td, self.tokenizer, self.generate_responses, sampling=self.sampling, stop_token_ids=self._stop_ids
        )


class StopStrings(StoppingCriteria):
    """Ends a row once the text it generated contains one of ``sampling.stop_strings``.

    One :class:`~lmcollect.engines.running_request.StopStringWatch` per row (the matcher every
    engine uses) looks at the text each step added; ``min_new_tokens`` holds the check off, as it
    holds eos off. :attr:`lengths` gives each row's response length: up to the token completing
    the string (generate pads the row after it), or ``max_new_tokens`` for rows that never matched.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, sampling: SamplingConfig, *, prompt_width: int) -> None:
        self.tokenizer, self.stop_strings = tokenizer, sampling.stop_strings
        self.min_new_tokens, self.max_new_tokens = sampling.min_new_tokens, sampling.max_new_tokens
        self.prompt_width = prompt_width
        self._stopped: list[bool] = []
        self._watches: list[StopStringWatch] = []
        self._lengths: list[int] = []

    @property
    def lengths(self) -> list[int]:
        """Response length of each row (``max_new_tokens`` where no stop string matched)."""
        return self._lengths

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs: Any) -> torch.BoolTensor:
        num_rows, num_new = input_ids.shape[0], input_ids.shape[1] - self.prompt_width
        if not self._stopped:  # first step: the batch size is known now
            self._stopped, self._lengths = [False] * num_rows, [self.max_new_tokens] * num_rows
            self._watches = [StopStringWatch(self.tokenizer, self.stop_strings) for _ in range(num_rows)] if self.stop_strings else []
        for row, watch in enumerate(self._watches):
            if not self._stopped[row]:
                generated = input_ids[row, self.prompt_width :].tolist()
                if watch.matched(generated, check=num_new >= self.min_new_tokens):
                    self._stopped[row], self._lengths[row] = True, num_new
        return torch.tensor(self._stopped, dtype=torch.bool, device=input_ids.device)
