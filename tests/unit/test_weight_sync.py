"""Weight updaters and schemes with in-process collectors: versions, atomicity, cascades, real tiny model."""
from __future__ import annotations

import gc
import pickle
import threading
from collections.abc import Callable

import pytest
import torch
from torch import nn

from lmcollect.collectors import LLMCollector
from lmcollect.data import keys
from lmcollect.data.turns import flatten_turns
from lmcollect.envs import ChatEnv, MathAnswerReward, arithmetic_dataset
from lmcollect.testing import ScriptedPolicy
from lmcollect.weight_sync import LocalWeightUpdater, SharedMemorySender, WeightUpdaterBase, pack_buckets
from tests.factories import run_in_thread
from lmcollect.transports.process_group import ProcessGroupConfig, ProcessGroupReceiver, ProcessGroupSender


class TinyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight
        self.norm = nn.LayerNorm(4)
        self.register_buffer("scratch", torch.ones(3), persistent=False)


class ModelPolicy(ScriptedPolicy):
    """A scripted policy that owns a model and counts prefix-cache resets."""

    def __init__(self) -> None:
        super().__init__("#### 1")
        self.model = TinyNet()
        self.cache_resets = 0

    def reset_prefix_cache(self) -> None:
        self.cache_resets += 1


def make_env() -> ChatEnv:
    return ChatEnv(arithmetic_dataset(64, seed=0), reward_fn=MathAnswerReward(), batch_size=2, seed=0)


def make_collector(**kwargs) -> LLMCollector:
    return LLMCollector(make_env(), policy=ModelPolicy(), dialog_turns_per_batch=2, track_policy_version=True, **kwargs)


def trained() -> TinyNet:
    net = TinyNet()
    with torch.no_grad():
        for p in net.parameters():
            p.add_(1.0)
    return net


def state(collector: LLMCollector) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in collector.policy.model.state_dict().items()}


def assert_weights(collector: LLMCollector, source: nn.Module) -> None:
    got, want = collector.policy.model.state_dict(), source.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)


def versions(batch) -> set[int]:
    return set(batch[keys.POLICY_VERSION].flatten().tolist())


# ---------------------------------------------------------------------- the updater API
def test_local_updater_loads_in_place_and_bumps_the_version_once() -> None:
    trainer = trained()
    updater = LocalWeightUpdater(trainer)
    collector = make_collector(weight_updater=updater)
    params_before = [p.data_ptr() for p in collector.policy.model.parameters()]
    assert versions(collector.next()) == {0}
    collector.update_policy_weights_()
    assert_weights(collector, trainer)
    assert [p.data_ptr() for p in collector.policy.model.parameters()] == params_before  # in place
    assert collector.policy_version == 1 and collector.policy.cache_resets == 1
    assert versions(collector.next()) == {1}
    updater(trainer)  # calling the updater pushes
    updater.push_weights(trainer.state_dict(), worker_ids=[0])
    assert collector.policy_version == 3
    assert collector.policy.model.head.weight is collector.policy.model.embed.weight


def test_every_source_form_is_accepted() -> None:
    from tensordict import TensorDict
    from tensordict.nn import TensorDictModule

    trainer = trained()
    collector = make_collector(weight_updater=LocalWeightUpdater())
    sources = [
        trainer,
        TensorDictModule(trainer, in_keys=["x"], out_keys=["y"]),
        TensorDict(trainer.state_dict(), batch_size=[]),
        dict(trainer.state_dict()),
    ]
    for i, source in enumerate(sources, start=1):
        collector.update_policy_weights_(source)
        assert collector.policy_version == i
        assert_weights(collector, trainer)


def test_registration_is_once_and_weak() -> None:
    updater = LocalWeightUpdater()
    collector = make_collector(weight_updater=updater)
    assert updater.collector is collector
    with pytest.raises(RuntimeError, match="already registered"):
        updater.register_collector(make_collector())
    with pytest.raises(RuntimeError, match="already registered"):
        make_collector().weight_updater = updater
    assert pickle.loads(pickle.dumps(updater)).collector is None  # the weak link does not travel
    del collector
    gc.collect()
    assert updater.collector is None
    with pytest.raises(RuntimeError, match="no live collector"):
        updater.push_weights(trained())


def test_constructor_post_hooks_and_errors() -> None:
    collector = make_collector(weight_updater=LocalWeightUpdater)  # a constructor is called
    updater = collector.weight_updater
    assert isinstance(updater, LocalWeightUpdater) and updater.collector is collector
    calls: list[int] = []
    updater.register_post_hook(lambda: calls.append(collector.policy_version))
    assert updater.post_hooks and callable(updater.post_hooks[0])
    updater.push_weights(trained())
    assert calls == [1]  # after the weights were applied
    with pytest.raises(TypeError, match="post hook must be callable"):
        updater.register_post_hook(3)
    with pytest.raises(ValueError, match=r"unknown worker\(s\) \[1\]"):
        updater.push_weights(trained(), worker_ids=[0, 1])
    with pytest.raises(ValueError, match="no weights to push"):
        updater.push_weights()
    with pytest.raises(TypeError, match="weight_updater must be"):
        make_collector().weight_updater = 3
    assert WeightUpdaterBase.from_policy(collector.policy) is None
    assert isinstance(LocalWeightUpdater.from_policy(collector.policy), LocalWeightUpdater)
    assert set(WeightUpdaterBase.get_model_metadata(collector.policy)) == {"embed.weight", "norm.weight", "norm.bias"}


def test_init_updater_and_increment_version_reach_the_collector() -> None:
    seen: list[tuple] = []

    class RecordingUpdater(LocalWeightUpdater):
        def init(self, *args, **kwargs) -> None:
            seen.append((args, kwargs))

    collector = make_collector(weight_updater=RecordingUpdater())
    collector.init_updater({"w": (torch.float32, torch.Size([1]))}, flag=True)
    assert seen == [(({"w": (torch.float32, torch.Size([1]))},), {"flag": True})]
    collector.weight_updater.increment_version()
    assert collector.policy_version == 1


@pytest.mark.parametrize(
    "spoil",
    [
        lambda w: w.pop("norm.bias"),
        lambda w: w.update(extra=torch.zeros(1)),
        lambda w: w.update({"norm.weight": torch.zeros(5)}),
        lambda w: w.update({"norm.weight": torch.zeros(4, dtype=torch.float64)}),
    ],
    ids=["missing", "extra", "shape", "dtype"],
)
def test_bad_push_changes_nothing(spoil) -> None:
    collector = make_collector(weight_updater=LocalWeightUpdater())
    before = state(collector)
    weights = dict(trained().state_dict())
    spoil(weights)
    with pytest.raises(ValueError, match="no weight was changed"):
        collector.update_policy_weights_(weights)
    after = state(collector)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert collector.policy_version == 0 and collector.policy.cache_resets == 0


def test_one_error_lists_every_problem_and_dtype_conversion_is_opt_in() -> None:
    weights = {k: v.double() for k, v in trained().state_dict().items()}
    weights.pop("norm.bias")
    with pytest.raises(ValueError, match=r"4 problem\(s\).*missing 'norm.bias'.*float64"):
        make_collector(weight_updater=LocalWeightUpdater()).update_policy_weights_(weights)
    collector = make_collector(weight_updater=LocalWeightUpdater(convert_dtype=True))
    trainer = trained()
    collector.update_policy_weights_({k: v.double() for k, v in trainer.state_dict().items()})
    assert_weights(collector, trainer)
    assert collector.policy.model.norm.weight.dtype == torch.float32


def test_no_updater_applies_directly_and_receive_weights_forms() -> None:
    trainer = trained()
    collector = make_collector()
    collector.update_policy_weights_(trainer)
    collector.receive_weights(weights=trainer.state_dict())
    collector.receive_weights(policy=trainer)
    assert collector.policy_version == 3
    assert_weights(collector, trainer)
    with pytest.raises(ValueError, match="only one"):
        collector.receive_weights(trainer, weights=trainer.state_dict())
    with pytest.raises(ValueError, match="one worker"):
        collector.update_policy_weights_(trainer, worker_ids=[1])
    with pytest.raises(ValueError, match="nothing to push or pull"):
        collector.update_policy_weights_()  # no updater, no schemes: a clear error, nothing changes
    assert collector.policy_version == 3
    assert collector.weight_metadata()[1] == {"head.weight": "embed.weight"}


# ---------------------------------------------------------------------- schemes
def test_shared_memory_scheme_pulls_only_new_pushes() -> None:
    sender = SharedMemorySender()
    trainer = trained()
    sender.send(trainer)
    collector = make_collector()
    collector.register_scheme_receiver({"policy": sender.make_receiver()})  # synchronize_weights pulls
    assert collector.policy_version == 1
    assert_weights(collector, trainer)
    collector.receive_weights()  # nothing new
    assert collector.policy_version == 1
    with torch.no_grad():
        trainer.norm.bias.fill_(5)
    sender.send(trainer)
    collector.receive_weights()
    assert collector.policy_version == 2 and torch.equal(collector.policy.model.norm.bias, torch.full((4,), 5.0))
    with torch.no_grad():
        trainer.norm.bias.fill_(6)
    collector.receive_weights(trainer)  # given weights load at once, schemes or not
    assert collector.policy_version == 3 and torch.equal(collector.policy.model.norm.bias, torch.full((4,), 6.0))
    bad = dict(trainer.state_dict()) | {"extra": torch.zeros(1)}
    sender.send(bad)
    before = state(collector)
    with pytest.raises(ValueError, match="unexpected 'extra'"):
        collector.receive_weights()
    assert all(torch.equal(v, state(collector)[k]) for k, v in before.items()) and collector.policy_version == 3


def test_shared_memory_receiver_waits_for_a_push_up_to_its_timeout() -> None:
    sender = SharedMemorySender()
    receiver = sender.make_receiver(timeout_s=5.0)
    collector = make_collector()
    collector.register_scheme_receiver({"policy": receiver}, synchronize_weights=False)
    timer = threading.Timer(0.2, sender.send, args=(trained(),))
    timer.start()
    collector.receive_weights()  # blocks until the push lands
    timer.join()
    assert collector.policy_version == 1
    assert receiver.receive() is None  # nothing newer


def test_get_model_resolves_registered_ids() -> None:
    collector = make_collector()
    collector.register_scheme_receiver({"critic": SharedMemorySender().make_receiver()}, synchronize_weights=False)
    assert collector.get_model("policy") is collector.policy.model
    assert collector.get_model("critic") is collector.policy.model  # the scheme names no model of its own
    with pytest.raises(ValueError, match=r"unknown model_id 'value'.*\['policy', 'critic'\]"):
        collector.get_model("value")


def test_process_group_scheme_over_gloo() -> None:
    sender = ProcessGroupSender(ProcessGroupConfig(num_receivers=1, backend="gloo", timeout_s=30, bucket_size_bytes=256))
    collector = make_collector()
    collector.register_scheme_receiver({"policy": ProcessGroupReceiver(timeout_s=30)}, synchronize_weights=False)
    # the spec's path form, resolved by attribute and item access only
    collector.cascade_execute("_receiver_schemes['policy']._set_dist_connection_info", sender.connection_info(), worker_idx=0)
    joined = run_in_thread(lambda: collector.cascade_execute("_receiver_schemes['policy'].connect"))
    sender.connect()
    joined()
    trainer = trained()
    for push in range(1, 3):
        pulled = run_in_thread(collector.receive_weights)
        sender.send(trainer)
        pulled()
        assert collector.policy_version == push
        assert_weights(collector, trainer)
        with torch.no_grad():
            trainer.norm.weight.mul_(2)
    before = state(collector)
    with pytest.raises(ValueError, match=r"receiver 1: 'norm.weight' has shape \(5,\)"):
        sender.send(dict(trainer.state_dict()) | {"norm.weight": torch.zeros(5)})  # nothing is broadcast
    assert all(torch.equal(v, state(collector)[k]) for k, v in before.items())
    assert collector._receiver_schemes["policy"].receive(timeout_s=0.2) is None  # no push is pending
    sender.close()


# ---------------------------------------------------------------------- the real tiny model
def test_greedy_outputs_follow_pushed_weights(tiny_model_path) -> None:
    from lmcollect.models import load_model_and_tokenizer
    from lmcollect.policies import TransformersPolicy

    model, tokenizer = load_model_and_tokenizer(tiny_model_path)
    trainer, _ = load_model_and_tokenizer(tiny_model_path)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.05)
    env = ChatEnv(arithmetic_dataset(64, seed=0), reward_fn=MathAnswerReward(), batch_size=4, seed=0)
    policy = TransformersPolicy(model, tokenizer, max_new_tokens=6, temperature=0)
    collector = LLMCollector(env, policy=policy, dialog_turns_per_batch=4, track_policy_version=True,
                             weight_updater=LocalWeightUpdater(trainer))
    assert versions(collector.next()) == {0}
    collector.update_policy_weights_()
    turns = flatten_turns(collector.next())
    assert {int(t[keys.POLICY_VERSION]) for t in turns} == {1}
    fresh, _ = load_model_and_tokenizer(tiny_model_path)
    fresh.load_state_dict(trainer.state_dict())
    texts = [t[keys.TEXT_PROMPT] for t in turns]
    _, responses, log_probs = TransformersPolicy(fresh, tokenizer, max_new_tokens=6, temperature=0).generate(texts)
    for turn, response, lp in zip(turns, responses, log_probs):
        assert torch.equal(turn[keys.TOKENS_RESPONSE], response)
        torch.testing.assert_close(turn[keys.LOG_PROBS_RESPONSE], lp)
    old, _ = load_model_and_tokenizer(tiny_model_path)
    _, _, old_log_probs = TransformersPolicy(old, tokenizer, max_new_tokens=6, temperature=0).generate(texts)
    assert not torch.allclose(old_log_probs[0][:1], log_probs[0][:1])  # the push changed the outputs


@pytest.mark.gpu
def test_cuda_model_takes_cpu_weights_and_buckets_pack_on_the_gpu() -> None:
    collector = make_collector(weight_updater=LocalWeightUpdater())
    collector.policy.model.cuda()
    trainer = trained()
    collector.update_policy_weights_(trainer)
    got = {k: v.cpu() for k, v in collector.policy.model.state_dict().items()}
    assert all(torch.equal(got[k], v) for k, v in trainer.state_dict().items())
    assert collector.policy.model.head.weight is collector.policy.model.embed.weight
    buckets = pack_buckets(trainer.cuda().state_dict())
    assert all(b.is_cuda for b in buckets.buffers)
    assert all(torch.equal(buckets.tensors()[k], v) for k, v in trainer.state_dict().items())


# ---------------------------------------------------------------------- zero-copy loads
def test_zero_copy_points_at_the_pushed_memory_and_a_later_copy_unshares() -> None:
    collector = make_collector()
    source = trained()
    payload = pack_buckets(source.state_dict())  # one flat buffer: the model must map into it
    buffer = payload.buffers[0]
    buffer_ptr, buffer_end = buffer.data_ptr(), buffer.data_ptr() + buffer.numel()
    collector.receive_weights(payload, zero_copy=True)
    model = collector.policy.model
    assert_weights(collector, source)
    for name, tensor in model.state_dict().items():  # every state tensor lives in the pushed buffer
        assert buffer_ptr <= tensor.data_ptr() < buffer_end, name
    assert model.head.weight is model.embed.weight  # still tied
    assert torch.equal(model.scratch, torch.ones(3))  # non-persistent buffers are left alone
    assert collector.policy_version == 1
    # A copying push must not write into the shared buffer: the model gets private tensors first.
    before, other = buffer.clone(), TinyNet()
    collector.receive_weights(other)
    assert torch.equal(buffer, before)
    for tensor in model.state_dict().values():
        assert not buffer_ptr <= tensor.data_ptr() < buffer_end
    assert_weights(collector, other)
    assert model.head.weight is model.embed.weight and collector.policy_version == 2


def test_zero_copy_refuses_a_bad_push_without_changing_anything() -> None:
    collector = make_collector()
    before = state(collector)
    spoiled = trained().state_dict()
    spoiled["norm.weight"] = torch.zeros(5)
    with pytest.raises(ValueError, match="norm.weight"):
        collector.receive_weights(spoiled, zero_copy=True)
    assert all(torch.equal(v, before[k]) for k, v in collector.policy.model.state_dict().items())
    assert collector.policy_version == 0


def test_zero_copy_and_delta_cannot_be_combined() -> None:
    from lmcollect.weight_sync import PushConfig

    with pytest.raises(ValueError, match="zero_copy=True and delta"):
        PushConfig(zero_copy=True, delta=True)


def test_the_held_dtypes_of_receivers_that_must_agree() -> None:
    from lmcollect.weights.tensors import agreed_held_dtypes

    weights = {"w": torch.zeros(2, dtype=torch.float32), "b": torch.zeros(2, dtype=torch.bfloat16), "tied": torch.zeros(1)}
    bf16 = ({"w": (torch.bfloat16, (2,)), "b": (torch.bfloat16, (2,)), "emb": (torch.float32, (1,))}, {"tied": "emb"})
    assert agreed_held_dtypes(weights, [bf16, bf16], why_one="-") == {"w": torch.bfloat16}  # only what differs
    fp16 = ({**bf16[0], "w": (torch.float16, (2,))}, bf16[1])
    with pytest.raises(ValueError, match=r"receivers hold 'w' in different dtypes \['torch.bfloat16', 'torch.float16'\]; give"):
        agreed_held_dtypes(weights, [bf16, fp16], why_one="give every engine the same dtype.")
