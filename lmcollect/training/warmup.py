"""A short supervised warm-up: teach a freshly initialised model the answer format before RL."""

from __future__ import annotations

import logging
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from lmcollect.envs.datasets import row_to_history
from lmcollect.training.grpo import pack_turns, sft_loss, token_log_probs
from lmcollect.training.trainer import trainable_parameters

if TYPE_CHECKING:  # transformers is heavy; the caller has already imported it to build the model
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


@dataclass(kw_only=True)
class WarmupConfig:
    """Supervised fine-tuning on the task's reference answers."""

    num_steps: int = 40
    """Optimizer steps (0 skips the warm-up)."""
    batch_size: int = 32
    """Examples per step."""
    lr: float = 1e-3
    """AdamW learning rate."""
    seed: int = 0
    """Seed of the example order."""

    def __post_init__(self) -> None:
        if self.num_steps < 0:
            raise ValueError(f"num_steps must be >= 0, got {self.num_steps}.")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}.")
        if self.lr <= 0:
            raise ValueError(f"lr must be positive, got {self.lr}.")


def encode_example(row: Mapping[str, Any], tokenizer: PreTrainedTokenizerBase) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt tokens as the policy sees them, reference answer tokens + eos) of one dataset row."""
    if "answer" not in row:
        raise ValueError(f"row {row!r} has no 'answer'; the warm-up imitates reference answers.")
    prompt = row_to_history(row).apply_chat_template(tokenizer)
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    answer_ids = tokenizer(str(row["answer"]), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return torch.tensor(prompt_ids), torch.tensor(answer_ids)


def warm_up(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    rows: Sequence[Mapping[str, Any]],
    config: WarmupConfig,
) -> list[float]:
    """Train ``model`` in place on ``config.num_steps`` batches of reference answers; returns the losses.

    The parameters that require gradients are trained: all of a plain model, the adapter's of a peft model.
    """
    if not rows:
        raise ValueError("the warm-up needs at least one row with a reference answer.")
    examples = [encode_example(row, tokenizer) for row in rows]
    optimizer = torch.optim.AdamW(trainable_parameters(model), lr=config.lr, weight_decay=0.0)
    rng = random.Random(config.seed)
    losses = []
    model.train()
    for step in range(config.num_steps):
        batch = [examples[rng.randrange(len(examples))] for _ in range(config.batch_size)]
        packed = pack_turns([p for p, _ in batch], [a for _, a in batch], pad_token_id=tokenizer.pad_token_id)
        loss = sft_loss(token_log_probs(model, packed), packed)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        logger.debug("warm-up step %d: loss %.3f", step, losses[-1])
    model.eval()
    return losses
