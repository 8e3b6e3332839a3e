"""vLLMUpdater's defaults without an engine: the master address it picks, and dtype conversion on the sender."""
from __future__ import annotations

import sys

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from lmcollect.weights.buckets import pack_buckets, plan_layout
from lmcollect.transports.process_group import ProcessGroupConfig, ProcessGroupReceiver, ProcessGroupSender
from lmcollect.weight_sync.vllm_updater import LOOPBACK, default_master_address, vLLMUpdater
from lmcollect.engines.vllm.worker_ext import EngineWeights, RayNode, current_ray_node
from lmcollect.weights.tensors import tensor_metadata

TRAINER = RayNode(node_id="node-a", ip="10.0.0.1")


# ---------------------------------------------------------------------- master_address
def test_loopback_when_every_worker_is_on_the_trainer_node_or_ray_is_not_running() -> None:
    assert default_master_address(None, []) == LOOPBACK == "127.0.0.1"
    assert default_master_address(None, ["node-b"]) == LOOPBACK  # no Ray here: nothing can be elsewhere
    assert default_master_address(TRAINER, ["node-a"]) == LOOPBACK
    assert default_master_address(TRAINER, ["node-a", "node-a"]) == LOOPBACK  # tp workers, replicas


def test_the_trainer_node_ip_when_some_worker_is_on_another_node() -> None:
    assert default_master_address(TRAINER, ["node-b"]) == "10.0.0.1"
    assert default_master_address(TRAINER, ["node-a", "node-b"]) == "10.0.0.1"  # one remote replica is enough


def test_the_address_is_chosen_at_init_unless_given() -> None:
    assert vLLMUpdater().master_address is None
    assert vLLMUpdater("10.1.2.3").master_address == "10.1.2.3"
    ray = sys.modules.get("ray")  # a full run may have started Ray in this process already
    if ray is None or not ray.is_initialized():  # without Ray an updater uses loopback
        assert current_ray_node() is None


# ---------------------------------------------------------------------- convert_dtype
def weights_fp32() -> dict[str, torch.Tensor]:
    embed = torch.randn(6, 4)
    return {"embed.weight": embed, "head.weight": embed, "norm.weight": torch.randn(4), "steps": torch.arange(3)}


def test_buckets_cast_while_packing_and_keep_ties() -> None:
    weights = weights_fp32()
    dtypes = {"embed.weight": torch.bfloat16, "head.weight": torch.bfloat16, "norm.weight": torch.bfloat16}
    buckets = pack_buckets(weights, dtypes=dtypes)
    got = buckets.tensors()
    for name, tensor in weights.items():
        assert got[name].dtype == dtypes.get(name, tensor.dtype)
        assert torch.equal(got[name], tensor.to(got[name].dtype))
    slots = {slot.name: slot for slot in buckets.layout.slots}
    assert (slots["head.weight"].buffer_index, slots["head.weight"].offset_bytes) == (
        slots["embed.weight"].buffer_index,
        slots["embed.weight"].offset_bytes,
    )
    # a bf16 buffer (the tied 6x4 once, 48 bytes padded to 64, then 4 norm values) and an int64 one
    assert buckets.layout.buffer_nbytes == plan_layout(weights, dtypes=dtypes).buffer_nbytes == (64 + 8, 24)


def push_once(convert_dtype: bool, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """One gloo push from an fp32 sender into a receiver holding bfloat16 floats (None: nothing arrived)."""
    held = {k: (torch.bfloat16 if v.is_floating_point() else v.dtype, v.shape) for k, v in weights.items()}
    context = EngineWeights({k: v for k, v in held.items() if k != "head.weight"}, {"head.weight": "embed.weight"})
    config = ProcessGroupConfig(num_receivers=1, backend="gloo", timeout_s=30, convert_dtype=convert_dtype)
    sender, receiver = ProcessGroupSender(config), ProcessGroupReceiver(timeout_s=30)
    receiver.init_on_receiver(model_id="policy", context=context)
    receiver.set_connection_info(sender.connection_info(), worker_idx=0)
    with ThreadPoolExecutor(1) as pool:
        joined = pool.submit(receiver.connect)
        sender.connect()
        joined.result(timeout=30)
        try:
            received = pool.submit(receiver.receive, 2.0)
            sender.send(weights)
            return received.result(timeout=30)
        except ValueError:
            assert received.result(timeout=30) is None  # refused before anything was broadcast
            raise
        finally:
            sender.close()
            receiver.close()


def test_fp32_into_bf16_is_refused_without_convert_dtype() -> None:
    with pytest.raises(ValueError, match=r"has dtype torch.float32, the model expects torch.bfloat16 \(pass convert_dtype=True"):
        push_once(False, weights_fp32())


def test_convert_dtype_casts_on_the_sender_and_sends_only_the_engine_bytes() -> None:
    weights = weights_fp32()
    received = push_once(True, weights)
    assert received is not None
    assert tensor_metadata(received)["norm.weight"] == (torch.bfloat16, torch.Size([4]))
    for name, tensor in weights.items():
        assert torch.equal(received[name], tensor.to(received[name].dtype)), name
    assert received["steps"].dtype == torch.int64  # integers are never cast
