"""A whole lockstep batch answered by one ``model.generate`` call (``TransformersEngine.generate_batch``).

Rows are left-padded into one prefill; each step's raw log-prob is gathered as it is drawn
(:class:`~lmcollect.engines.hf.step_log_probs.StepLogProbs`). Seeded requests each draw from their
own ``torch.Generator``, as in the engine's continuous loop, so a seeded request gives the same
tokens whatever else shares the batch; a batch of unseeded requests samples from torch's global
RNG, as ``generate`` does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from lmcollect.engines.hf.running_request import StopStringWatch, request_generator
from lmcollect.engines.hf.step_log_probs import StepLogProbs, no_generate_warpers
from lmcollect.engines.protocol import EngineRequest, EngineResult
from lmcollect.engines.sampling import SamplingConfig

if TYPE_CHECKING:  # transformers' classes: the caller built the model
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["generate_together", "response_lengths", "shared_batch_settings"]


def shared_batch_settings(requests: Sequence[EngineRequest]) -> tuple[SamplingConfig, tuple[int, ...]]:
    """The one ``sampling`` and ``stop_token_ids`` every request of a ``generate`` batch shares."""
    if not requests:
        raise ValueError("generate_batch needs at least one request.")
    first = requests[0]
    for request in requests[1:]:
        if request.sampling != first.sampling or request.stop_token_ids != first.stop_token_ids:
            raise ValueError(
                f"request {request.request_id!r} has other sampling or stop_token_ids than {first.request_id!r}: "
                "one generate_batch call samples every row alike; submit() such requests one by one instead."
            )
    return first.sampling, first.stop_token_ids


@torch.inference_mode()
def generate_together(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    requests: Sequence[EngineRequest],
    *,
    eos_token_ids: list[int],
    version: int,
) -> list[EngineResult]:
    """Each request's :class:`EngineResult`, from one left-padded ``model.generate`` call."""
    sampling, extra_stops = shared_batch_settings(requests)
    device = next(model.parameters()).device
    input_ids, attention = _left_pad([r.prompt_ids for r in requests], tokenizer.pad_token_id, device)
    stop_ids = list(extra_stops) + [i for i in eos_token_ids if i not in extra_stops and not sampling.ignore_eos]
    seeded = not sampling.greedy and any(r.seed is not None for r in requests)
    generators = [request_generator(r, device) for r in requests] if seeded else None
    steps = StepLogProbs(sampling, eos_token_ids, generators=generators)
    stop = StopStrings(tokenizer, sampling, prompt_width=input_ids.shape[1])
    with steps.attached(model):
        sequences = model.generate(
            input_ids=input_ids,
            attention_mask=attention,
            logits_processor=steps.processor,
            stopping_criteria=StoppingCriteriaList([*steps.criterion, stop]),
            **_generate_kwargs(sampling, stop_ids, tokenizer.pad_token_id, draws_own=generators is not None),
        )
    generated = sequences[:, input_ids.shape[1] :]
    log_probs, sampled = steps.log_probs(generated.shape[1])
    ends = response_lengths(generated, stop_ids, stop.lengths)
    return [
        EngineResult(
            tokens=generated[i, :n].cpu(),
            log_probs=log_probs[i, :n].cpu(),
            token_versions=torch.full((n,), version, dtype=torch.int64),
            finish_reason="stop" if stopped else "length",
            sampled_log_probs=None if sampled is None else sampled[i, :n].cpu(),
        )
        for i, (n, stopped) in enumerate(ends)
    ]


def _generate_kwargs(
    sampling: SamplingConfig, stop_ids: list[int], pad_token_id: int, *, draws_own: bool
) -> dict[str, Any]:
    # min_new_tokens and repetition_penalty are generate's own processors, which run before
    # StepLogProbs' (so sampled log-probs see them); explicit values override a model's
    # generation_config (None drops its processor). When StepLogProbs draws the rows' tokens
    # itself (seeded rows), generate decodes greedily: its argmax picks the one token left.
    greedy = sampling.greedy or draws_own
    return {
        "max_new_tokens": sampling.max_new_tokens,
        "min_new_tokens": sampling.min_new_tokens or None,
        "repetition_penalty": sampling.repetition_penalty if sampling.repetition_penalty != 1.0 else None,
        "do_sample": not greedy,
        "pad_token_id": pad_token_id,
        "eos_token_id": stop_ids or None,
        **no_generate_warpers(greedy=greedy),
    }


def _left_pad(prompt_ids: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(ids) for ids in prompt_ids)
    input_ids = torch.full((len(prompt_ids), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(prompt_ids), width), dtype=torch.long)
    for row, ids in enumerate(prompt_ids):
        input_ids[row, width - len(ids) :] = torch.as_tensor(ids, dtype=torch.long)
        attention[row, width - len(ids) :] = 1
    return input_ids.to(device), attention.to(device)


def response_lengths(
    generated: torch.Tensor, stop_ids: Sequence[int], stop_string_lengths: Sequence[int] = ()
) -> list[tuple[int, bool]]:
    """Each row's response length and whether it stopped (on a stop id or a stop string).

    A row ends at its first stop id (kept) or at the token completing a stop string (kept), if
    sooner; later positions are padding. Tokens equal to the pad id before the end are real output,
    so rows are never stripped by pad id.
    """
    width = generated.shape[1]
    if stop_ids:
        is_stop = torch.isin(generated, torch.tensor(list(stop_ids), device=generated.device))
        lengths = torch.where(is_stop.any(dim=1), is_stop.int().argmax(dim=1) + 1, width + 1).tolist()
    else:
        lengths = [width + 1] * generated.shape[0]
    ends = []
    for n, by_string in zip(lengths, stop_string_lengths or [width + 1] * len(lengths), strict=True):
        ends.append((min(n, by_string, width), min(n, by_string) <= width))
    return ends


class StopStrings(StoppingCriteria):
    """Ends a row once the text it generated contains one of ``sampling.stop_strings``.

    One :class:`~lmcollect.engines.hf.running_request.StopStringWatch` per row (the matcher the
    continuous loop uses too) looks at the text each step added; ``min_new_tokens`` holds the check
    off, as it holds eos off. :attr:`lengths` gives each row's response length up to the token
    completing the string, or ``max_new_tokens + 1`` for rows that never matched.
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
        """Response length of each row (``max_new_tokens + 1`` where no stop string matched)."""
        return self._lengths

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs: Any) -> torch.BoolTensor:
        num_rows, num_new = input_ids.shape[0], input_ids.shape[1] - self.prompt_width
        if not self._stopped:  # first step: the batch size is known now
            self._stopped, self._lengths = [False] * num_rows, [self.max_new_tokens + 1] * num_rows
            self._watches = (
                [StopStringWatch(self.tokenizer, self.stop_strings) for _ in range(num_rows)]
                if self.stop_strings
                else []
            )
        for row, watch in enumerate(self._watches):
            if not self._stopped[row]:
                generated = input_ids[row, self.prompt_width :].tolist()
                if watch.matched(generated, check=num_new >= self.min_new_tokens):
                    self._stopped[row], self._lengths[row] = True, num_new
        return torch.tensor(self._stopped, dtype=torch.bool, device=input_ids.device)
