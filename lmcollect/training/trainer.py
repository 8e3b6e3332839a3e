"""The learner of the demo: one GRPO optimisation step on a batch of collected turns."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmcollect.training.batch import TrainBatch
from lmcollect.training.grpo import policy_gradient_loss, token_log_probs


@dataclass(kw_only=True)
class GRPOConfig:
    """Optimiser and loss settings of a GRPO step."""

    lr: float = 5e-4
    """AdamW learning rate (the tiny model collapses to reward 0 at 2e-3 on the demo task)."""
    clip_epsilon: float = 0.2
    """PPO clip range of the importance ratio new/behaviour policy."""
    max_grad_norm: float = 1.0
    """Gradients are clipped to this global norm."""

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"lr must be positive, got {self.lr}.")
        if not 0 < self.clip_epsilon < 1:
            raise ValueError(f"clip_epsilon must be in (0, 1), got {self.clip_epsilon}.")
        if self.max_grad_norm <= 0:
            raise ValueError(f"max_grad_norm must be positive, got {self.max_grad_norm}.")


class GRPOLearner:
    """Owns the trained model's optimiser; :meth:`train_step` is one policy-gradient update.

    Only parameters with ``requires_grad`` are trained: of a peft model, its adapter's.
    """

    def __init__(self, model: torch.nn.Module, config: GRPOConfig) -> None:
        self.model = model
        self.config = config
        self.params = trainable_parameters(model)
        self.optimizer = torch.optim.AdamW(self.params, lr=config.lr, weight_decay=0.0)

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """Forward the batch, clipped PG loss, backward, clip, step; returns the loss metrics."""
        self.model.train()
        log_probs = token_log_probs(self.model, batch.packed)
        clip = self.config.clip_epsilon
        loss, metrics = policy_gradient_loss(log_probs, batch.packed, batch.advantages, clip_epsilon=clip)
        self.optimizer.zero_grad()
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.config.max_grad_norm)
        self.optimizer.step()
        self.model.eval()
        return {**metrics, "loss/grad_norm": float(grad_norm)}


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """``model``'s parameters that require gradients (all of a plain model, the adapter's of a peft one)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError(f"{type(model).__name__} has no parameter that requires gradients: nothing to train.")
    return params
