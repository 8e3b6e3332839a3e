"""The demo's weight push: the trainer's weights to every collector, through the backend's updater."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from lmcollect.cli.configs import Backend
from lmcollect.ray.updater import RayRemoteWeightUpdater
from lmcollect.weight_sync.vllm_updater import vLLMUpdater

if TYPE_CHECKING:  # torch and Ray are imported by the caller that built these objects
    import torch

    from lmcollect.ray.collector import RayLLMCollector


def make_weight_pusher(
    model: torch.nn.Module, collectors: Sequence[RayLLMCollector], backend: Backend
) -> Callable[[], None]:
    """``push()`` sends ``model``'s current weights to every collector and returns once all have them.

    Every push bumps each collector's policy version by one, so turns generated afterwards carry
    the new version. Transformers collectors share one object-store copy (RayRemoteWeightUpdater);
    vLLM engines get the weights by broadcast over a process group, one vLLMUpdater per collector.
    """
    if backend == "vllm":
        for collector in collectors:
            collector.weight_updater = vLLMUpdater()

        def push() -> None:
            for collector in collectors:
                collector.update_policy_weights_(model)

        return push
    updater = RayRemoteWeightUpdater(model, list(collectors))

    def push_all() -> None:
        updater.push_weights()  # waits for every collector

    return push_all
