"""LoRA adapters whose merge overflows: finite factors and scaling that give inf weights once merged.

Part of the security suite (issue "Closed for real", item 6): a trainer gone wrong, or anyone who
can push, sends an adapter that passes every check on its own tensors (finite, right shapes and
rank) but whose ``base + scaling * B @ A`` is not finite in the model's dtype. It must be refused
with the model's weights and the collector's and engine's versions unchanged, through both
collectors, and a sound adapter must still load after it. (vLLM workers make the same check, with
the same function: tests/integration/test_vllm_engine.py, one in-process engine per test session.)
"""
from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from lmcollect.engines.protocol import engine_of
from lmcollect.weights.lora import LoraAdapter, LoraLayerWeights
from tests.lora_resume_worker import KINDS, build, close, model_of, weights_of

LAYERS = ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.v_proj.weight")
RANK = 4


def _adapter(model: torch.nn.Module, a: Callable, b: Callable, scaling: float = 2.0) -> LoraAdapter:
    """An adapter of rank 4 on LAYERS with ``A = a(shape)``, ``B = b(shape)``."""
    shapes = {name: model.state_dict()[name].shape for name in LAYERS}
    layers = {
        name: LoraLayerWeights(a((RANK, shape[1])), b((shape[0], RANK)), scaling) for name, shape in shapes.items()
    }
    return LoraAdapter(layers=layers, rank=RANK)


def huge_factors(model: torch.nn.Module) -> LoraAdapter:
    """1e20 everywhere: finite in float32, but every element of B @ A is 4e40."""
    return _adapter(model, lambda s: torch.full(s, 1e20), lambda s: torch.full(s, 1e20))


def huge_scaling(model: torch.nn.Module) -> LoraAdapter:
    """Factors of 1, scaling 1e38 (a finite float): every element of scaling * B @ A is 4e38."""
    return _adapter(model, lambda s: torch.ones(s), lambda s: torch.ones(s), scaling=1e38)


def fp16_overflow(model: torch.nn.Module) -> LoraAdapter:
    """Finite once merged in float32 (8e4), past float16's 65504: for a model held in float16."""
    return _adapter(model, lambda s: torch.full(s, 100.0), lambda s: torch.full(s, 100.0))


def sound(model: torch.nn.Module) -> LoraAdapter:
    return _adapter(model, lambda s: torch.full(s, 0.01), lambda s: torch.full(s, 0.02))


def _assert_unchanged(collector, before: dict[str, torch.Tensor], version: int) -> None:
    after = weights_of(collector)
    assert all(torch.equal(before[name], tensor) for name, tensor in after.items())
    assert collector.version_index() == version and engine_of(collector.policy).version == version


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("overflowing", [huge_factors, huge_scaling, fp16_overflow])
def test_an_adapter_whose_merge_overflows_is_refused_with_nothing_changed(kind, overflowing, tiny_model_path) -> None:
    collector = build(kind, str(tiny_model_path))
    try:
        model = model_of(collector)
        if overflowing is fp16_overflow:
            model.half()
        collector.update_policy_weights_(sound(model))  # an adapter held: the refusal must keep it
        before, version = weights_of(collector), collector.version_index()
        with pytest.raises(ValueError, match=r"not finite in their dtype .* nothing was loaded"):
            collector.update_policy_weights_(overflowing(model))
        _assert_unchanged(collector, before, version)
        with pytest.raises(ValueError, match="not finite in their dtype"):
            collector.receive_weights(overflowing(model))  # no updater: the collector's own path
        _assert_unchanged(collector, before, version)
        collector.update_policy_weights_(sound(model))  # a sound one still loads, on the same base
        assert collector.version_index() > version
        assert all(torch.equal(before[name], tensor) for name, tensor in weights_of(collector).items())
    finally:
        close(collector)


def test_a_large_bound_whose_merge_is_finite_is_loaded(tiny_model_path) -> None:
    """Factors whose bound passes float16's range while their product cancels out (B's columns of
    opposite signs): the merge decides, and it is finite, so the adapter loads."""
    collector = build("continuous", str(tiny_model_path))
    try:
        model = model_of(collector).half()
        before = weights_of(collector)
        signs = torch.tensor([1.0, -1.0, 1.0, -1.0])
        cancelling = _adapter(model, lambda s: torch.full(s, 100.0), lambda s: torch.full(s, 100.0) * signs)
        collector.update_policy_weights_(cancelling)
        after = weights_of(collector)
        assert all(torch.equal(before[name], tensor) for name, tensor in after.items())  # B @ A == 0
        assert collector.version_index() == 1
    finally:
        close(collector)
