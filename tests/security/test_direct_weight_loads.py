"""Weights given straight to a collector (no updater): NaN/Inf refused as the updaters refuse them.

Part of the security suite (issue 42, item 7): ``update_policy_weights_(weights)`` on a collector
without a weight updater, and ``receive_weights(weights)``, load through the collector alone;
each test asserts the refusal and that weights and version did not change.
"""
from __future__ import annotations

import pytest
import torch

from lmcollect.collectors import LLMCollector
from tests.factories import SmallModelPolicy, make_arithmetic_env


def _collector(policy: SmallModelPolicy | None = None) -> LLMCollector:
    return LLMCollector(
        make_arithmetic_env(), policy=policy or SmallModelPolicy(), dialog_turns_per_batch=1, track_policy_version=True
    )


def _weights(value: float, broken: float | None = None) -> dict[str, torch.Tensor]:
    weights = {name: torch.full_like(t, value) for name, t in SmallModelPolicy().model.state_dict().items()}
    if broken is not None:
        weights["norm.weight"][2] = broken
    return weights


def _held(collector: LLMCollector) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in collector.get_policy_model().state_dict().items()}


def _unchanged(collector: LLMCollector, before: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(before[k], v) for k, v in collector.get_policy_model().state_dict().items())


@pytest.mark.parametrize("load", ["update_policy_weights_", "receive_weights"])
@pytest.mark.parametrize("broken", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
def test_weights_holding_nan_or_inf_given_without_an_updater_are_refused(load: str, broken: float) -> None:
    collector = _collector()
    assert collector.weight_updater is None
    before = _held(collector)
    with pytest.raises(ValueError, match=r"no weight was changed: 1 problem\(s\): 'norm.weight' holds NaN or infinite values \(allow_non_finite=True"):
        getattr(collector, load)(_weights(0.5, broken))
    assert _unchanged(collector, before) and collector.policy_version == 0
    getattr(collector, load)(_weights(0.5))  # finite weights load
    assert collector.policy_version == 1


def test_a_direct_load_finite_in_fp32_but_infinite_in_the_models_fp16_is_refused() -> None:
    policy = SmallModelPolicy()
    policy.model.half()
    collector = _collector(policy)
    before = _held(collector)
    with pytest.raises(ValueError, match=r"'norm.weight' holds NaN or infinite values once cast to torch.float16"):
        collector.receive_weights(_weights(0.5, broken=1e5), convert_dtype=True)  # fp16 holds at most 65504
    assert _unchanged(collector, before) and collector.policy_version == 0


def test_allow_non_finite_loads_them_on_purpose() -> None:
    collector = _collector()
    collector.receive_weights(_weights(0.5, float("inf")), allow_non_finite=True)
    assert torch.isposinf(collector.get_policy_model().norm.weight[2]) and collector.policy_version == 1
