"""One request inside the engine: its tokens so far, how it picks the next one, and when it ends."""

from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING

import torch
from transformers import RepetitionPenaltyLogitsProcessor

from lmcollect.engines.hf.step_log_probs import draw_tokens, sampling_warpers
from lmcollect.engines.kv_policy import KVPolicy, kv_versions_of
from lmcollect.engines.protocol import EngineRequest, EngineResult

if TYPE_CHECKING:  # only for annotations; the engine passes the tokenizer it was built with
    from transformers import PreTrainedTokenizerBase


def request_generator(request: EngineRequest, device: torch.device) -> torch.Generator:
    """The generator a request samples from: seeded by ``request.seed`` (None: a seed drawn from torch's global RNG)."""
    seed = request.seed if request.seed is not None else int(torch.randint(2**62, ()).item())
    return torch.Generator(device=device).manual_seed(seed)


class RunningRequest:
    """A submitted request's state, from the queue to its last token.

    Each step the engine hands it the raw logits of its next position (:meth:`append_next`). The raw
    log-prob (log-softmax at temperature 1) is recorded before anything changes the scores; then,
    as ``generate`` orders them, the repetition penalty, the ``min_new_tokens`` and ``ignore_eos``
    masks, and (sampling only) temperature / top-k / top-p apply, and the token is the argmax or a
    draw with this request's own ``torch.Generator`` (:func:`~lmcollect.engines.hf.step_log_probs.draw_tokens`),
    so its tokens never depend on which other requests share the batch.
    """

    def __init__(
        self,
        request: EngineRequest,
        *,
        eos_token_ids: list[int],
        tokenizer: PreTrainedTokenizerBase,
        device: torch.device,
        kv_policy: KVPolicy = "recompute",
    ) -> None:
        self.request = request
        self.kv_policy = kv_policy
        self.future: Future[EngineResult] = Future()
        self.sampling = sampling = request.sampling
        self.generator = request_generator(request, device)
        self.warpers = sampling_warpers(sampling)
        penalty = sampling.repetition_penalty
        self.repetition = RepetitionPenaltyLogitsProcessor(penalty) if penalty != 1.0 else None
        # ignore_eos: the model's eos is never drawn; the request's own stop ids still end it (as in vLLM)
        self.banned_ids = sorted(eos_token_ids) if sampling.ignore_eos else []
        self.stop_ids = set(request.stop_token_ids) | (set() if sampling.ignore_eos else set(eos_token_ids))
        self.stop_strings = StopStringWatch(tokenizer, sampling.stop_strings) if sampling.stop_strings else None
        self.tokens: list[int] = []
        self.log_probs: list[float] = []
        self.sampled_log_probs: list[float] = []
        self.versions: list[int] = []
        self.finish_reason: str | None = None
        self.in_batch = False
        """Whether the engine's batch cache holds this request's keys/values (all known tokens but the last)."""

    @property
    def known_ids(self) -> list[int]:
        """The prompt and every token generated so far."""
        return [*self.request.prompt_ids, *self.tokens]

    @property
    def num_known(self) -> int:
        return len(self.request.prompt_ids) + len(self.tokens)

    def append_next(self, logits: torch.Tensor, *, version: int) -> None:
        """Pick the next token from ``logits`` (float32 ``[vocab]``), record it and check whether the response ends."""
        scores = self._processed(logits.unsqueeze(0))
        if self.sampling.greedy:
            token = int(scores.argmax(-1))
            sampled_log_prob = 0.0  # argmax: the chosen token had probability 1
        else:
            for warper in self.warpers:
                scores = warper(None, scores)  # transformers' warpers never read input_ids
            token = int(draw_tokens(scores, [self.generator])[0])
            sampled_log_prob = float(scores.log_softmax(-1)[0, token])
        self.tokens.append(token)
        self.log_probs.append(float(logits.log_softmax(-1)[token]))
        self.sampled_log_probs.append(sampled_log_prob)
        self.versions.append(version)
        self.finish_reason = self._finish_reason(token)

    def _processed(self, scores: torch.Tensor) -> torch.Tensor:
        """The scores before temperature / top-k / top-p: repetition penalty, then the masks."""
        if self.repetition is not None:
            ids = torch.tensor([self.known_ids], device=scores.device)
            scores = self.repetition(ids, scores)
        banned = self.banned_ids
        if len(self.tokens) < self.sampling.min_new_tokens:
            banned = sorted({*banned, *self.stop_ids})
        if banned:
            scores = scores.clone()
            scores[:, banned] = -float("inf")
        return scores

    def _finish_reason(self, token: int) -> str | None:
        num_new = len(self.tokens)
        if token in self.stop_ids:  # masked while num_new <= min_new_tokens
            return "stop"
        if self.stop_strings is not None and self.stop_strings.matched(
            self.tokens, check=num_new >= self.sampling.min_new_tokens
        ):
            return "stop"
        return "length" if num_new >= self.sampling.max_new_tokens else None

    def result(self) -> EngineResult:
        versions = torch.tensor(self.versions, dtype=torch.int64)
        return EngineResult(
            tokens=torch.tensor(self.tokens, dtype=torch.int64),
            log_probs=torch.tensor(self.log_probs, dtype=torch.float32),
            token_versions=versions,
            # no prefix cache: the prompt's keys/values are computed for this request, at its first token
            kv_versions=kv_versions_of(versions, kv_policy=self.kv_policy),
            finish_reason=self.finish_reason or "length",
            sampled_log_probs=(
                torch.tensor(self.sampled_log_probs, dtype=torch.float32) if self.sampling.sampled_log_probs else None
            ),
        )


class StopStringWatch:
    """Finds the first step at which a response's text contains one of the stop strings.

    Each call decodes the generated tokens (special tokens skipped; the prompt never counts) and
    looks only at the text added since the previous call, plus as many characters before it as the
    longest stop string has (a byte-level token may complete the previous character), as
    the ``generate`` batch path's ``StopStrings`` does.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop_strings: tuple[str, ...]) -> None:
        self.tokenizer, self.stop_strings = tokenizer, stop_strings
        self._window = max(len(s) for s in stop_strings)
        self._checked_chars = 0

    def matched(self, tokens: list[int], *, check: bool = True) -> bool:
        """Whether the text of ``tokens`` now contains a stop string (``check=False``: only advance)."""
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        start = max(0, self._checked_chars - self._window)
        self._checked_chars = len(text)
        return check and any(s in text[start:] for s in self.stop_strings)
