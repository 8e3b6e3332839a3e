"""Delta weight pushes without Ray: encodings after a real AdamW step in bf16, a collector applying
deltas (versions, checksums, atomicity), and the process-group scheme over gloo with a refused delta."""
from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.factories import run_in_thread as shared_run_in_thread
import torch

from lmcollect.collectors import LLMCollector
from lmcollect.envs import ChatEnv, MathAnswerReward, arithmetic_dataset
from lmcollect.models import load_model_and_tokenizer
from lmcollect.testing import ScriptedPolicy
from lmcollect.weights.buckets import WeightBuckets
from lmcollect.weights.delta import (
    DeltaBase,
    DeltaConfig,
    DeltaRejectedError,
    EncodedDelta,
    WeightDelta,
    prepare_delta,
    resolve_delta,
)
from lmcollect.transports.process_group import PreparedPush, ProcessGroupConfig, ProcessGroupReceiver, ProcessGroupSender
from lmcollect.weights.version import PushVersion
from lmcollect.weights.tensors import unique_targets


@pytest.fixture()
def bf16_model(tiny_model_path: Path) -> torch.nn.Module:
    return load_model_and_tokenizer(tiny_model_path)[0].to(torch.bfloat16)


def adamw_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    """One real optimizer step: the LM loss on a few random token sequences."""
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(seed))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def clone_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def same_state(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return got.keys() == want.keys() and all(torch.equal(got[k].view(-1), want[k].view(-1)) for k in want)


def corrupted(delta: WeightDelta, *, buffer: int = -1, byte: int = 0) -> WeightDelta:
    """A copy of ``delta`` with one bit flipped on the way (the sender's own arrays stay intact)."""
    buffers = [b.clone() for b in delta.arrays.buffers]
    buffers[buffer][byte] ^= 1
    return WeightDelta(delta.base_version, delta.entries, WeightBuckets(delta.arrays.layout, buffers))


# ---------------------------------------------------------------------- encoding and applying
@pytest.mark.parametrize("encoding", ["auto", "indices", "bitmask"])
def test_a_real_adamw_step_in_bf16_travels_as_a_small_exact_delta(bf16_model, encoding) -> None:
    base = DeltaBase(DeltaConfig(encoding=encoding))
    receiver = copy.deepcopy(bf16_model)  # keeps lm_head tied to the embedding
    targets, aliases = unique_targets(receiver)
    base.snapshot(bf16_model.state_dict(), PushVersion(1))
    optimizer = torch.optim.AdamW(bf16_model.parameters(), lr=1e-5)
    held = base.version
    for step in range(3):
        adamw_step(bf16_model, optimizer, seed=step)
        encoded = base.encode(bf16_model.state_dict())
        assert encoded is not None
        stats = encoded.stats()
        assert 0 < stats.num_changed < stats.numel and stats.nbytes < 0.5 * stats.full_nbytes
        used = {e.encoding for e in encoded.delta.entries}
        assert used <= {"indices", "bitmask", "dense"} and (encoding == "auto" or encoding in used)
        prepare_delta(encoded.delta, targets, held_version=held, aliases=aliases).apply_()
        held = PushVersion(step + 2)
        base.commit(encoded, held)
        assert same_state(receiver.state_dict(), bf16_model.state_dict())  # bit for bit, tied lm_head included
        assert same_state(base.tensors, {k: bf16_model.state_dict()[k] for k in base.tensors})


def test_tied_weights_travel_once_and_a_large_change_falls_back_to_a_full_push(bf16_model) -> None:
    state = bf16_model.state_dict()
    base = DeltaBase(DeltaConfig(max_fraction=0.3))
    base.snapshot(state, PushVersion(1))
    assert bf16_model.config.tie_word_embeddings and "lm_head.weight" not in base.tensors
    with torch.no_grad():
        bf16_model.lm_head.weight[0, :4] += 1.0  # the tied embedding changes with it
    encoded = base.encode(bf16_model.state_dict())
    assert [(e.name, e.num_changed) for e in encoded.delta.entries] == [("model.embed_tokens.weight", 4)]
    with torch.no_grad():
        for p in bf16_model.parameters():
            p.add_(1.0)
    assert base.encode(bf16_model.state_dict()) is None  # above max_fraction: send everything
    assert base.encode({k: v for k, v in state.items() if k != "model.norm.weight"}) is None  # other names
    with pytest.raises(ValueError, match="max_fraction"):
        DeltaConfig(max_fraction=0.0)
    assert resolve_delta(False) is None and resolve_delta(True) == DeltaConfig()


def test_fp32_weights_are_compared_in_the_receivers_bf16() -> None:
    weights = {"w": torch.linspace(-1, 1, 4096)}
    base = DeltaBase(DeltaConfig())
    base.snapshot(weights, PushVersion(1), dtypes={"w": torch.bfloat16})
    assert base.tensors["w"].dtype == torch.bfloat16
    nudged = {"w": weights["w"] + 1e-7}  # below bf16's resolution: nothing to send
    assert base.encode(nudged, {"w": torch.bfloat16}).delta.entries == ()
    moved = {"w": weights["w"].clone()}
    moved["w"][:3] += 0.5
    (entry,) = base.encode(moved, {"w": torch.bfloat16}).delta.entries
    assert entry.num_changed == 3


# ---------------------------------------------------------------------- a collector receiving deltas
class ModelPolicy(ScriptedPolicy):
    """A scripted policy owning a bf16 model; counts prefix-cache resets."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__("#### 1")
        self.model = model
        self.cache_resets = 0

    def reset_prefix_cache(self) -> None:
        self.cache_resets += 1


def make_collector(model: torch.nn.Module) -> LLMCollector:
    env = ChatEnv(arithmetic_dataset(16, seed=0), reward_fn=MathAnswerReward(), batch_size=2, seed=0)
    return LLMCollector(env, policy=ModelPolicy(model), dialog_turns_per_batch=2, track_policy_version=True)


def test_a_collector_applies_only_good_deltas_onto_their_base(bf16_model, tiny_model_path) -> None:
    collector = make_collector(load_model_and_tokenizer(tiny_model_path)[0].to(torch.bfloat16))
    policy = collector.policy
    base = DeltaBase(DeltaConfig())
    v1 = PushVersion(1)
    collector.receive_weights(bf16_model, version=v1)
    base.snapshot(bf16_model.state_dict(), v1)
    optimizer = torch.optim.AdamW(bf16_model.parameters(), lr=1e-5)
    adamw_step(bf16_model, optimizer, seed=0)
    encoded = base.encode(bf16_model.state_dict())
    before, resets = clone_state(policy.model), policy.cache_resets

    def refused(delta: WeightDelta, version: PushVersion, match: str) -> None:
        held = collector.policy_version
        with pytest.raises(DeltaRejectedError, match=match):
            collector.receive_weights(delta, version=version)
        assert same_state(clone_state(policy.model), before), "a refused delta changed weights"
        assert collector.policy_version == held and policy.cache_resets == resets

    refused(corrupted(encoded.delta), PushVersion(2), "checksum mismatch")  # a value flipped on the way
    positions = next(i for i, s in enumerate(encoded.delta.arrays.layout.slots) if s.name.endswith(".positions"))
    refused(corrupted(encoded.delta, buffer=positions, byte=1), PushVersion(2), "checksum|positions")
    other_base = WeightDelta(PushVersion(1), encoded.delta.entries, encoded.delta.arrays)  # same index, other push
    refused(other_base, PushVersion(2), "applies to version 1")
    with pytest.raises(TypeError, match="version"):
        collector.receive_weights(encoded.delta)

    collector.receive_weights(encoded.delta, version=PushVersion(2, "two"))
    assert same_state(clone_state(policy.model), bf16_model.state_dict())
    assert collector.policy_version == 2 and policy.cache_resets == resets + 1
    collector.receive_weights(bf16_model)  # a push without a version: no delta can follow it
    base.commit(encoded, PushVersion(2, "two"))
    refused_now = base.encode(bf16_model.state_dict())
    before, resets = clone_state(policy.model), policy.cache_resets
    refused(refused_now.delta, PushVersion(4), "holds no pushed version")


# ---------------------------------------------------------------------- the process-group scheme
class CorruptingSender(ProcessGroupSender):
    """Flips one bit of the next delta on its way to the receivers."""

    corrupt_next = False

    def prepare(self, weights: object) -> PreparedPush:
        prepared = super().prepare(weights)
        if self.corrupt_next and prepared.encoded is not None:
            self.corrupt_next = False
            encoded = prepared.encoded
            prepared.encoded = EncodedDelta(corrupted(encoded.delta), encoded.positions, encoded.values, encoded.numel, encoded.full_nbytes)
        return prepared


def run_in_thread(fn: Callable[[], object]) -> Callable[[], object]:
    return shared_run_in_thread(fn, timeout_s=60)
def test_process_group_delta_pushes_and_a_refused_delta_repaired_in_the_same_push(bf16_model, tiny_model_path) -> None:
    config = ProcessGroupConfig(num_receivers=1, backend="gloo", timeout_s=30, bucket_size_bytes=1 << 20, delta=DeltaConfig())
    sender = CorruptingSender(config)
    collector = make_collector(load_model_and_tokenizer(tiny_model_path)[0].to(torch.bfloat16))
    receiver = ProcessGroupReceiver(timeout_s=30)
    collector.register_scheme_receiver({"policy": receiver}, synchronize_weights=False)
    receiver.set_connection_info(sender.connection_info(), worker_idx=0)
    joined = run_in_thread(receiver.connect)
    sender.connect()
    joined()
    optimizer = torch.optim.AdamW(bf16_model.parameters(), lr=1e-5)
    try:
        kinds = []
        for push in range(1, 5):
            sender.corrupt_next = push == 4
            pulled = run_in_thread(collector.receive_weights)
            sender.send(bf16_model, version=PushVersion(push))
            pulled()
            kinds.append((sender.last_push_stats.kind, sender.last_push_stats.num_repaired, receiver.last_receive_info["kind"]))
            assert collector.policy_version == push
            assert same_state(clone_state(collector.policy.model), bf16_model.state_dict())
            assert sender.last_checksums() == receiver.last_checksums()  # the patched copies agree
            adamw_step(bf16_model, optimizer, seed=push)
        assert kinds == [("full", 0, "full"), ("delta", 0, "delta"), ("delta", 0, "delta"), ("full", 1, "full")]
        assert "checksum" in receiver.last_receive_info["after_refused_delta"]["refused"]
    finally:
        sender.close()
        receiver.close()
