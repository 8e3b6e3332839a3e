"""The demo's weight push: the trainer's weights to every collector, through the backend's updater."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lmcollect.ray.updater import RayRemoteWeightUpdater
from lmcollect.weight_sync.vllm_updater import vLLMUpdater

if TYPE_CHECKING:  # torch is imported by the caller that built the model
    import torch

    from lmcollect.weights.delta import PushStats


class WeightPusher:
    """``push(model)`` sends ``model``'s weights to every collector and returns once all have them,
    with what the push moved (None: not known).

    ``model`` is the trainer's model (a full push), or a peft model (a LoRA push: only the adapter's
    tensors travel, and each collector's engine merges them into the base weights it holds, the last
    full push). Every push bumps each collector's policy version by one, so turns generated afterwards
    carry the new version. Transformers collectors share one object-store copy per push
    (RayRemoteWeightUpdater); vLLM engines get the weights by broadcast over a process group (an
    adapter in the engine's load call), one vLLMUpdater per collector.
    """

    def __init__(self, collectors: list[Any], backend: str) -> None:
        self._collectors = collectors
        self._updater: RayRemoteWeightUpdater | None = None
        if backend == "vllm":
            for collector in collectors:
                collector.weight_updater = vLLMUpdater()
        else:
            self._updater = RayRemoteWeightUpdater(None, collectors)

    def __call__(self, model: torch.nn.Module) -> PushStats | None:
        if self._updater is not None:
            self._updater.push_weights(model)  # waits for every collector
            return self._updater.last_push_stats
        for collector in self._collectors:
            collector.update_policy_weights_(model)
        return self._collectors[-1].weight_updater.last_push_stats  # each collector got the same
