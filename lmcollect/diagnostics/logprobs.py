"""Train-inference mismatch: recompute the stored log-probs with a forward pass and report the differences."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch
from tensordict import TensorDictBase

from lmcollect.data import keys
from lmcollect.data.turns import flatten_turns

if TYPE_CHECKING:  # transformers is heavy; only the type of the model is needed here
    from transformers import PreTrainedModel

DEFAULT_TOKENS_PER_FORWARD = 8192


class StoredSequence(NamedTuple):
    """One collected turn: all its tokens and the log-probs stored for the last ``len(log_probs)`` of them."""

    tokens: torch.Tensor
    log_probs: torch.Tensor
    stale_context: torch.Tensor | None = None
    """bool, one per stored log-prob: the token attended to keys/values older than its own weights
    (``kv_versions < token_versions``, ``kv_policy="keep"``); None: unknown (counted as fresh)."""


def stale_context_of(token_versions: torch.Tensor | None, kv_versions: torch.Tensor | None) -> torch.Tensor | None:
    """Which tokens attended to keys/values computed by older weights than their own (None if either is unknown)."""
    if token_versions is None or kv_versions is None:
        return None
    return torch.as_tensor(kv_versions) < torch.as_tensor(token_versions)


@dataclass(frozen=True, kw_only=True)
class LogProbReport:
    """How far stored log-probs are from a forward pass; ``diff = recomputed - stored`` per token.

    ``recomputed`` is what the trainer sees (its forward pass), ``stored`` what the inference
    engine reported, so ``exp(sum diff)`` over a sequence is the importance ratio
    p_trainer(sequence) / p_inference(sequence) that a perfectly on-policy step would have (1).
    """

    num_sequences: int
    """Sequences compared (turns with at least one response token)."""
    num_tokens: int
    """Response tokens compared."""
    mean_abs_diff: float
    """Mean over tokens of |diff|."""
    max_abs_diff: float
    """Largest |diff| of any token."""
    mean_exp_abs_diff: float
    """Mean over tokens of exp(|diff|): 1 when identical; the per-token mismatch peers report."""
    min_sequence_ratio: float
    """Smallest per-sequence ratio exp(sum diff)."""
    max_sequence_ratio: float
    """Largest per-sequence ratio exp(sum diff)."""
    mean_sequence_ratio: float
    """Mean per-sequence ratio exp(sum diff)."""
    num_stale_context_tokens: int = 0
    """Tokens generated over keys/values of older weights than their own (``kv_policy="keep"`` after a
    push: ``("collector", "kv_versions") < ("collector", "token_versions")``): their stored log-probs
    are not what any single set of weights gives, so |diff| there measures what "keep" costs."""
    max_abs_diff_fresh_context: float = 0.0
    """Largest |diff| over the other tokens (whose whole context was computed by their own weights)."""

    def summary(self) -> str:
        """A few human-readable lines."""
        return (
            f"{self.num_sequences} sequences, {self.num_tokens} response tokens; diff = recomputed - stored\n"
            f"|diff|: mean {self.mean_abs_diff:.3e}, max {self.max_abs_diff:.3e}; "
            f"mean exp(|diff|) per token {self.mean_exp_abs_diff:.6f}\n"
            f"per-sequence ratio exp(sum diff): min {self.min_sequence_ratio:.6f}, "
            f"mean {self.mean_sequence_ratio:.6f}, max {self.max_sequence_ratio:.6f}\n"
            f"tokens over keys/values of older weights (kv_policy='keep'): {self.num_stale_context_tokens}; "
            f"max |diff| of the others {self.max_abs_diff_fresh_context:.3e}"
        )

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)


def check_logprobs(
    model: PreTrainedModel,
    batch: TensorDictBase,
    *,
    key: tuple[str, str] = keys.LOG_PROBS_RESPONSE,
    tokens_per_forward: int = DEFAULT_TOKENS_PER_FORWARD,
) -> LogProbReport:
    """Recompute ``batch``'s stored log-probs with ``model`` over ``("tokens", "full")`` and compare.

    ``batch`` is anything a collector yields (a lazy stack of turns, any shape). The comparison is
    against the raw log-probs (``key``, default ``("log_probs", "response")``): those a trainer's
    forward pass at temperature 1 gives. Run the model as your trainer does (dtype, eval mode).

    Example::

        report = lmcollect.check_logprobs(trainer_model, batch)
        print(report.summary())  # mean / max |diff|, mean exp(|diff|), per-sequence ratios
    """
    sequences = [
        StoredSequence(
            turn.get(keys.TOKENS_FULL),
            turn.get(key),
            stale_context_of(turn.get(keys.TOKEN_VERSIONS, None), turn.get(keys.KV_VERSIONS, None)),
        )
        for turn in flatten_turns(batch)
    ]
    return compare_log_probs(model, sequences, tokens_per_forward=tokens_per_forward)


def compare_log_probs(
    model: PreTrainedModel, sequences: Sequence[StoredSequence], *, tokens_per_forward: int = DEFAULT_TOKENS_PER_FORWARD
) -> LogProbReport:
    """:func:`check_logprobs` on plain (tokens, stored log-probs) pairs, e.g. rows read from a rollouts file."""
    sequences = [s for s in sequences if s.log_probs.numel() > 0]
    if not sequences:
        raise ValueError("no sequence has stored log-probs to compare; collect some turns first.")
    for s in sequences:
        if s.log_probs.numel() >= s.tokens.numel():
            raise ValueError(
                f"a sequence has {s.log_probs.numel()} log-probs for {s.tokens.numel()} tokens; "
                "log-probs cover the response, which must follow at least one prompt token."
            )
    recomputed = recompute_log_probs(
        model,
        [s.tokens for s in sequences],
        [s.log_probs.numel() for s in sequences],
        tokens_per_forward=tokens_per_forward,
    )
    diffs = [r - s.log_probs.double() for r, s in zip(recomputed, sequences, strict=True)]
    stale = [
        s.stale_context if s.stale_context is not None else torch.zeros(s.log_probs.numel(), dtype=torch.bool)
        for s in sequences
    ]
    return _report(diffs, stale)


@torch.no_grad()
def recompute_log_probs(
    model: PreTrainedModel,
    tokens: Sequence[torch.Tensor],
    num_response: Sequence[int],
    *,
    tokens_per_forward: int = DEFAULT_TOKENS_PER_FORWARD,
) -> list[torch.Tensor]:
    """Log-probs (float64, on CPU) of the last ``num_response[i]`` tokens of each ``tokens[i]`` under ``model``.

    Sequences are left-padded in chunks of about ``tokens_per_forward`` tokens, and logits are
    kept only for the response positions (``logits_to_keep``), so memory stays bounded.
    """
    order = sorted(range(len(tokens)), key=lambda i: tokens[i].numel())
    out: list[torch.Tensor | None] = [None] * len(tokens)
    for chunk in _chunks(order, [tokens[i].numel() for i in order], tokens_per_forward):
        for i, log_probs in zip(
            chunk, _forward_chunk(model, [tokens[i] for i in chunk], [num_response[i] for i in chunk]), strict=True
        ):
            out[i] = log_probs
    return out


def _chunks(order: list[int], lengths: list[int], tokens_per_forward: int) -> list[list[int]]:
    chunks: list[list[int]] = [[]]
    for index, length in zip(
        order, lengths, strict=True
    ):  # sorted by length: the padded size is count x current length
        if chunks[-1] and (len(chunks[-1]) + 1) * length > tokens_per_forward:
            chunks.append([])
        chunks[-1].append(index)
    return chunks


def _forward_chunk(model: PreTrainedModel, tokens: list[torch.Tensor], num_response: list[int]) -> list[torch.Tensor]:
    device = next(model.parameters()).device
    width = max(t.numel() for t in tokens)
    input_ids = torch.zeros(len(tokens), width, dtype=torch.long)
    attention = torch.zeros(len(tokens), width, dtype=torch.long)
    for row, ids in enumerate(tokens):
        input_ids[row, width - ids.numel() :] = ids
        attention[row, width - ids.numel() :] = 1
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    keep = max(num_response) + 1  # logits at width-keep .. width-1 predict the last `keep - 1` tokens
    logits = model(
        input_ids=input_ids.to(device),
        attention_mask=attention.to(device),
        position_ids=positions.to(device),
        logits_to_keep=keep,
    ).logits
    log_probs = logits[:, :-1].float().log_softmax(-1)
    targets = input_ids[:, width - keep + 1 :].to(device)
    gathered = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1).double().cpu()
    return [gathered[row, gathered.shape[1] - n :] for row, n in enumerate(num_response)]


def _report(diffs: list[torch.Tensor], stale: list[torch.Tensor]) -> LogProbReport:
    flat = torch.cat(diffs)
    stale_flat = torch.cat(stale)
    fresh = flat[~stale_flat]
    ratios = torch.stack([d.sum() for d in diffs]).exp()
    return LogProbReport(
        num_sequences=len(diffs),
        num_tokens=flat.numel(),
        mean_abs_diff=float(flat.abs().mean()),
        max_abs_diff=float(flat.abs().max()),
        mean_exp_abs_diff=float(flat.abs().exp().mean()),
        min_sequence_ratio=float(ratios.min()),
        max_sequence_ratio=float(ratios.max()),
        mean_sequence_ratio=float(ratios.mean()),
        num_stale_context_tokens=int(stale_flat.sum()),
        max_abs_diff_fresh_context=float(fresh.abs().max()) if fresh.numel() else 0.0,
    )


__all__ = [
    "LogProbReport", "StoredSequence", "check_logprobs", "compare_log_probs", "recompute_log_probs", "stale_context_of",
]  # fmt: skip
