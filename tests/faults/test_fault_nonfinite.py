"""Pushes of weights holding NaN or Inf: refused before anything changes, unless allow_non_finite.

(vLLMUpdater's refusal is checked against a real engine in test_fault_vllm.py.)
"""
from __future__ import annotations

import time

import pytest
import torch

from lmcollect import LLMCollector
from lmcollect.ray.collector import RayLLMCollector
from lmcollect.ray import RayRemoteWeightUpdater
from lmcollect.weight_sync import PushConfig
from lmcollect.weight_sync import LocalWeightUpdater
from lmcollect.weights.tensors import non_finite_problems
from tests.factories import SmallModelPolicy, SmallNet, make_arithmetic_env


def broken_net(value: float) -> SmallNet:
    net = SmallNet()
    with torch.no_grad():
        net.norm.weight[3] = value
    return net


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_non_finite_problems_finds_nan_and_both_infinities_in_every_float_dtype(dtype: torch.dtype) -> None:
    for bad in (float("nan"), float("inf"), float("-inf")):
        weights = {"ok": torch.ones(5, dtype=dtype), "bad": torch.zeros(4, 3, dtype=dtype).t(), "ids": torch.arange(3)}
        weights["bad"][1, 2] = bad
        assert non_finite_problems(weights) == ["'bad' holds NaN or infinite values (allow_non_finite=True pushes it anyway)"]
    big = torch.full((4,), torch.finfo(dtype).max, dtype=dtype)  # finite values whose sum overflows
    assert non_finite_problems({"big": big, "empty": torch.empty(0, dtype=dtype)}) == []


@pytest.mark.fault_timeout(30)
def test_local_push_of_nan_is_refused_before_anything_changes(fault_table) -> None:
    updater = LocalWeightUpdater()
    collector = LLMCollector(make_arithmetic_env(), policy=SmallModelPolicy(), dialog_turns_per_batch=4,
                             weight_updater=updater, track_policy_version=True)
    held = SmallNet()
    held.load_state_dict(collector.get_policy_model().state_dict())
    started = time.monotonic()
    with pytest.raises(ValueError, match=r"no weight was changed: 1 problem\(s\): 'norm.weight' holds NaN"):
        collector.update_policy_weights_(broken_net(float("nan")))
    time_to_error = time.monotonic() - started
    assert same_weights(collector.get_policy_model(), held)
    assert collector.policy_version == updater.version == 0

    allowing = LocalWeightUpdater(allow_non_finite=True)
    collector.weight_updater = allowing
    collector.update_policy_weights_(broken_net(float("inf")))
    assert torch.isinf(collector.get_policy_model().norm.weight[3]) and collector.policy_version == 1
    collector.shutdown()
    fault_table.add("push of NaN weights (local)", "LocalWeightUpdater.push_weights of a model with a NaN",
                    "ValueError naming the tensor; weights and version unchanged; allow_non_finite=True pushes it",
                    time_to_error, None)


@pytest.mark.integration
@pytest.mark.fault_timeout(60)
def test_ray_push_of_inf_is_refused_on_the_driver(ray_cluster, fault_table) -> None:
    with RayLLMCollector(make_arithmetic_env, policy_factory=SmallModelPolicy, dialog_turns_per_batch=4,
                         track_policy_version=True, num_cpus=0.25) as collector:
        held = collector.get_policy_model()
        updater = RayRemoteWeightUpdater(broken_net(float("-inf")), [collector])
        started = time.monotonic()
        with pytest.raises(ValueError, match=r"'norm.weight' holds NaN or infinite values"):
            updater.push_weights()
        time_to_error = time.monotonic() - started
        assert same_weights(collector.get_policy_model(), held)
        assert collector.policy_version == updater.version == 0
        RayRemoteWeightUpdater(broken_net(float("-inf")), [collector], config=PushConfig(allow_non_finite=True)).push_weights()
        assert torch.isneginf(collector.get_policy_model().norm.weight[3]) and collector.policy_version == 1
    fault_table.add("push of Inf weights (Ray)", "RayRemoteWeightUpdater.push_weights of a model with a -Inf",
                    "ValueError on the driver before ray.put; the actor's weights and version unchanged; "
                    "PushConfig(allow_non_finite=True) pushes it", time_to_error, None)
