"""GRPO in plain torch: group-normalised advantages and a clipped token-level policy-gradient loss.

Nothing here knows about Ray, collectors or TensorDicts: inputs are lists of token tensors and
plain tensors, so the maths is unit-tested on its own (``tests/unit/test_grpo.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ADVANTAGE = "advantage"
"""TensorDict key of a turn's advantage (a float32 scalar), written next to its reward."""


def group_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, *, normalize_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """Each reward minus its group's mean reward (divided by the group's std with ``normalize_std``).

    ``rewards`` and ``group_ids`` are 1-D of the same length; answers with the same id answered
    the same prompt. A group of one, or one where every answer got the same reward, gets 0.
    """
    if rewards.ndim != 1 or rewards.shape != group_ids.shape:
        raise ValueError(
            f"rewards and group_ids must be 1-D of one length, got {tuple(rewards.shape)} and {tuple(group_ids.shape)}."
        )
    rewards = rewards.float()
    _, group = torch.unique(group_ids, return_inverse=True)
    num_groups = int(group.max()) + 1 if group.numel() else 0
    count = torch.zeros(num_groups).index_add_(0, group, torch.ones_like(rewards))
    mean = torch.zeros(num_groups).index_add_(0, group, rewards) / count
    centred = rewards - mean[group]
    if not normalize_std:
        return centred
    # unbiased std, as GRPO implementations use; a group of one has no spread
    var = torch.zeros(num_groups).index_add_(0, group, centred**2) / (count - 1).clamp(min=1)
    return centred / (var.sqrt()[group] + eps)


@dataclass(frozen=True, kw_only=True)
class PackedTurns:
    """Turns as right-padded ``prompt + response`` rows, with response tokens marked.

    ``targets_mask[i, j]`` is True when token ``j + 1`` of row ``i`` is a response token, i.e.
    when the logits at position ``j`` predict a response token (the usual one-step shift).
    """

    input_ids: torch.Tensor
    """int64 ``[N, L]``: prompt tokens, then response tokens, then padding."""
    attention_mask: torch.Tensor
    """int64 ``[N, L]``: 1 on real tokens."""
    targets_mask: torch.Tensor
    """bool ``[N, L - 1]``: positions whose next token is a response token."""
    old_log_probs: torch.Tensor
    """float32 ``[N, L - 1]``: log-prob of each response token under the weights that sampled it (0 elsewhere)."""

    @property
    def num_response_tokens(self) -> int:
        return int(self.targets_mask.sum())


def pack_turns(
    prompt_tokens: list[torch.Tensor],
    response_tokens: list[torch.Tensor],
    log_probs: list[torch.Tensor] | None = None,
    *,
    pad_token_id: int = 0,
) -> PackedTurns:
    """Pack per-turn token tensors into a :class:`PackedTurns` (``log_probs`` None: zeros, for SFT)."""
    if not prompt_tokens or len(prompt_tokens) != len(response_tokens):
        raise ValueError(
            f"need as many prompts as responses (> 0), got {len(prompt_tokens)} and {len(response_tokens)}."
        )
    lengths = [p.numel() + r.numel() for p, r in zip(prompt_tokens, response_tokens, strict=True)]
    n, width = len(lengths), max(lengths)
    input_ids = torch.full((n, width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((n, width), dtype=torch.long)
    targets_mask = torch.zeros((n, width - 1), dtype=torch.bool)
    old = torch.zeros((n, width - 1), dtype=torch.float32)
    for i, (prompt, response) in enumerate(zip(prompt_tokens, response_tokens, strict=True)):
        start, end = prompt.numel(), lengths[i]
        input_ids[i, :end] = torch.cat([prompt, response]).long()
        attention_mask[i, :end] = 1
        targets_mask[i, start - 1 : end - 1] = True
        if log_probs is not None:
            if log_probs[i].numel() != response.numel():
                raise ValueError(f"turn {i}: {log_probs[i].numel()} log-probs for {response.numel()} response tokens.")
            old[i, start - 1 : end - 1] = log_probs[i].float()
    return PackedTurns(input_ids=input_ids, attention_mask=attention_mask, targets_mask=targets_mask, old_log_probs=old)


def token_log_probs(model: torch.nn.Module, packed: PackedTurns) -> torch.Tensor:
    """``[N, L - 1]`` log-prob of each next token under ``model`` (a causal LM returning ``.logits``)."""
    logits = model(input_ids=packed.input_ids, attention_mask=packed.attention_mask).logits[:, :-1]
    return logits.float().log_softmax(-1).gather(-1, packed.input_ids[:, 1:, None]).squeeze(-1)


def policy_gradient_loss(
    log_probs: torch.Tensor,
    packed: PackedTurns,
    advantages: torch.Tensor,
    *,
    clip_epsilon: float = 0.2,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO-clipped policy-gradient loss, averaged over every response token of the batch.

    The behaviour policy is the one that generated the turns (``packed.old_log_probs``), so stale
    turns are corrected by the importance ratio ``exp(log_probs - old_log_probs)``, clipped as in
    PPO. Each token takes its turn's advantage (``advantages`` is ``[N]``). Averaging over tokens
    rather than over turns keeps long and short answers on one scale (DAPO's "token-mean").
    """
    mask = packed.targets_mask
    if advantages.shape != (mask.shape[0],):
        raise ValueError(f"advantages must have shape ({mask.shape[0]},), got {tuple(advantages.shape)}.")
    log_ratio = (log_probs - packed.old_log_probs).masked_fill(~mask, 0.0)
    ratio = log_ratio.exp()
    adv = advantages.float()[:, None]
    unclipped = ratio * adv
    clipped = ratio.clamp(1 - clip_epsilon, 1 + clip_epsilon) * adv
    per_token = -torch.minimum(unclipped, clipped)
    num_tokens = mask.sum().clamp(min=1)
    loss = per_token.masked_fill(~mask, 0.0).sum() / num_tokens
    with torch.no_grad():
        metrics = {
            "loss/policy": loss.item(),
            "loss/clip_fraction": float(
                ((ratio - 1).abs() > clip_epsilon).masked_fill(~mask, False).sum() / num_tokens
            ),
            # k3 estimator of KL(behaviour || current), a staleness / step-size diagnostic
            "loss/approx_kl": float(((ratio - 1) - log_ratio).masked_fill(~mask, 0.0).sum() / num_tokens),
        }
    return loss, metrics


def sft_loss(log_probs: torch.Tensor, packed: PackedTurns) -> torch.Tensor:
    """Mean negative log-likelihood of the response tokens (the warm-up's loss)."""
    mask = packed.targets_mask
    return -(log_probs.masked_fill(~mask, 0.0).sum() / mask.sum().clamp(min=1))
