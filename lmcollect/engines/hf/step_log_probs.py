"""Per-step log-probs for ``transformers`` ``generate``: the chosen token's, never all B x T x V logits."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from lmcollect.engines.sampling import SamplingConfig


def no_generate_warpers(*, greedy: bool) -> dict[str, Any]:
    """generate() arguments that keep its own warpers out.

    StepLogProbs applies temperature / top-k / top-p itself, so its scores are exactly those
    sampled; the None entries drop warpers a model's generation_config might otherwise add after
    ours (min-p, typical, epsilon, eta, top-h). Greedy decoding runs no warpers: all None (a
    neutral value such as top_k=0 would make generate warn that it is unused).
    """
    neutral = {"temperature": 1.0, "top_k": 0, "top_p": 1.0}
    others = ("min_p", "typical_p", "epsilon_cutoff", "eta_cutoff", "top_h")
    if greedy:
        return dict.fromkeys([*neutral, *others])
    return {**neutral, **dict.fromkeys(others)}


def sampling_warpers(sampling: SamplingConfig) -> list[LogitsProcessor]:
    """transformers' warpers for ``sampling``, in generate's order (none for greedy)."""
    if sampling.greedy:
        return []
    warpers: list[LogitsProcessor] = []
    if sampling.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(sampling.temperature))
    if sampling.top_k > 0:
        warpers.append(TopKLogitsWarper(top_k=sampling.top_k, min_tokens_to_keep=1))
    if sampling.top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=sampling.top_p, min_tokens_to_keep=1))
    return warpers


def draw_tokens(scores: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """One token per row of ``scores`` (``[B, vocab]``, after the warpers), sampled from
    ``softmax(scores)`` with row ``i``'s uniform noise drawn from ``generators[i]`` (Gumbel-max:
    ``argmax(scores + Gumbel noise)``), so a row's draw depends on its own generator and scores
    only. The engine's continuous loop and its ``generate`` batch path both sample this way."""
    noise = torch.stack([torch.rand(scores.shape[-1], generator=g, device=scores.device) for g in generators])
    return (scores.float() - torch.log(-torch.log(noise))).argmax(-1)


class StepLogProbs:
    """Gathers each generated token's log-prob step by step during one ``model.generate`` call.

    ``return_dict_in_generate=True, output_logits=True`` keeps every step's logits (B x T x V floats,
    1 GiB at B=32, T=256, V=32k); this keeps one step's at a time. Per step:

    1. a forward hook on the model keeps the last position's logits (exactly what ``generate``
       starts its processing from), so the raw log-probs do not depend on what processors run;
    2. :attr:`processor` (generate puts custom processors after its own, e.g. a repetition
       penalty, and before its warpers, which :func:`no_generate_warpers` switches off) masks eos
       for ``ignore_eos`` and applies temperature / top-k / top-p: its output is what is sampled;
    3. :attr:`criterion` (stopping criteria run once the step's token is appended) gathers that
       token's log-prob from the raw logits and, with ``sampled_log_probs``, from the sampled
       scores, then drops both.

    Use :meth:`attached` around ``generate`` and read :meth:`log_probs` afterwards.
    """

    def __init__(
        self, sampling: SamplingConfig, eos_token_ids: list[int], *, generators: list[torch.Generator] | None = None
    ) -> None:
        self.sampling = sampling
        self.eos_token_ids = eos_token_ids
        self.generators = generators
        self.warpers = sampling_warpers(sampling)
        self.processor = LogitsProcessorList([_Process(self)])
        self.criterion = StoppingCriteriaList([_Gather(self)])
        self._thread: int | None = None
        self._raw: torch.Tensor | None = None
        self._sampled: torch.Tensor | None = None
        self._raw_steps: list[torch.Tensor] = []
        self._sampled_steps: list[torch.Tensor] = []

    @contextmanager
    def attached(self, model: torch.nn.Module) -> Iterator[StepLogProbs]:
        """Record the raw logits of ``model``'s forward calls made by this thread meanwhile."""
        self._thread = threading.get_ident()
        handle = model.register_forward_hook(self._keep_raw_logits)
        try:
            yield self
        finally:
            handle.remove()
            self._thread = None
            self._raw = self._sampled = None

    def _keep_raw_logits(self, _module: torch.nn.Module, _args: Any, output: Any) -> None:
        if threading.get_ident() == self._thread:  # another thread may run the model (a trainer)
            self._raw = output.logits[:, -1].float()

    def warp(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.sampling.ignore_eos:
            scores = scores.clone()
            scores[:, self.eos_token_ids] = -float("inf")
        for warper in self.warpers:
            scores = warper(input_ids, scores)
        if self.sampling.sampled_log_probs:
            self._sampled = scores
        return self._drawn(scores, self.generators) if self.generators is not None else scores

    @staticmethod
    def _drawn(scores: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
        """Each row's token drawn from its own generator (:func:`draw_tokens`), returned as scores
        only that token survives: ``generate`` then decodes greedily and picks it."""
        chosen = draw_tokens(scores, generators).unsqueeze(-1)
        return torch.full_like(scores, -float("inf")).scatter_(1, chosen, 0.0)

    def gather(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self._raw is None:
            raise RuntimeError(
                "no logits were recorded for this step: call generate inside StepLogProbs.attached(model)."
            )
        chosen = input_ids[:, -1:]
        self._raw_steps.append(self._raw.log_softmax(-1).gather(-1, chosen).squeeze(-1))
        if self.sampling.sampled_log_probs:
            self._sampled_steps.append(self._sampled_log_probs(chosen))
        self._raw = self._sampled = None
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def _sampled_log_probs(self, chosen: torch.Tensor) -> torch.Tensor:
        if self.sampling.greedy:  # argmax: the chosen token had probability 1
            return torch.zeros(chosen.shape[0], device=chosen.device)
        assert self._sampled is not None, "warp() keeps the sampled scores when sampled_log_probs is set"
        return self._sampled.log_softmax(-1).gather(-1, chosen).squeeze(-1)

    def log_probs(self, num_steps: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Raw and (if asked) sampled log-probs, ``[B, num_steps]`` float32 (steps generate undid are dropped)."""
        if len(self._raw_steps) < num_steps:
            raise RuntimeError(f"recorded {len(self._raw_steps)} steps for {num_steps} generated tokens.")
        raw = torch.stack(self._raw_steps[:num_steps], dim=1)
        sampled = torch.stack(self._sampled_steps[:num_steps], dim=1) if self.sampling.sampled_log_probs else None
        return raw, sampled


class _Process(LogitsProcessor):
    def __init__(self, steps: StepLogProbs) -> None:
        self.steps = steps

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        return self.steps.warp(input_ids, scores)


class _Gather(StoppingCriteria):
    def __init__(self, steps: StepLogProbs) -> None:
        self.steps = steps

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs: Any) -> torch.BoolTensor:
        return self.steps.gather(input_ids)
