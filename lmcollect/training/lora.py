"""LoRA fine-tuning for the demo's learner: wrap the trained model in a peft LoRA adapter.

``peft`` is an optional extra (``pip install 'lmcollect[lora]'``): it is imported only here, when
an adapter is asked for.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

LORA_TARGETS = "all-linear"
"""peft's name for every linear layer of the decoder blocks (attention and MLP projections; not the
output head). Adapting the MLPs too matters for RL with LoRA: attention-only adapters learn less."""

MISSING_PEFT = "LoRA training needs peft: pip install 'lmcollect[lora]'"


def peft_available() -> bool:
    """True when ``peft`` can be imported."""
    return importlib.util.find_spec("peft") is not None


def wrap_lora(model: torch.nn.Module, rank: int, *, alpha: int | None = None) -> Any:
    """``model`` wrapped in a new peft LoRA adapter of ``rank`` (``lora_alpha`` 2 x rank unless
    ``alpha``; no dropout, no bias) on every linear layer of its decoder blocks.

    The base weights are frozen in place; only the adapter's parameters require gradients, so a
    learner given the returned model trains the adapter alone. The adapter starts as the identity
    (its B matrices are zero): the wrapped model answers as ``model`` did. ``model`` itself now
    computes with the adapter too (peft replaces its linear layers), so it can be evaluated or
    generated from as the adapted model; push the returned peft model to send only the adapter.
    """
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"a LoRA rank must be an integer >= 1, got {rank!r}.")
    if not peft_available():
        raise ImportError(f"{MISSING_PEFT}.")
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=rank,
        lora_alpha=2 * rank if alpha is None else alpha,
        target_modules=LORA_TARGETS,
        lora_dropout=0.0,
        bias="none",
    )
    return get_peft_model(model, config)


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(parameters that require gradients, all parameters) of ``model``."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable, sum(p.numel() for p in model.parameters())
