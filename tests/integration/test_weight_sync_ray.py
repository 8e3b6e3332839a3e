"""Weight pushes into RayLLMCollector actors: real tiny-model outputs, versions, skips, atomicity, faults."""
from __future__ import annotations

import functools
import threading
import time

import pytest
import ray
import torch
from torch import nn

from lmcollect.ray.collector import RayLLMCollector
from lmcollect.data import keys
from lmcollect.data.turns import flatten_turns
from lmcollect.models import load_model_and_tokenizer
from lmcollect.policies import TransformersPolicy
from lmcollect.weight_sync import WeightPushError
from lmcollect.ray.updater import PushHandle, RayRemoteWeightUpdater, RayWeightUpdater
from lmcollect.weight_sync import PushConfig
from lmcollect.transports.process_group import ProcessGroupConfig, ProcessGroupReceiver, ProcessGroupSender
from lmcollect.ray.object_store import RayObjectStoreSender
from tests.factories import SmallModelPolicy, SmallNet, make_arithmetic_env, make_greedy_tiny_policy, perturbed_model

pytestmark = pytest.mark.integration

MAX_NEW_TOKENS = 6
make_env = make_arithmetic_env


def start_collectors(n: int, policy_factory) -> list[RayLLMCollector]:
    """n collectors, started side by side (each actor takes seconds to import and load)."""
    out: list = [None] * n

    def build(i: int) -> None:
        out[i] = RayLLMCollector(
            make_env, policy_factory=policy_factory, dialog_turns_per_batch=4, track_policy_version=True, num_cpus=0.25
        )

    threads = [threading.Thread(target=build, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(c is not None for c in out), "a collector failed to start (see the log)"
    return out


@pytest.fixture(scope="module")
def tiny_collectors(ray_cluster, tiny_model_path):
    collectors = start_collectors(2, functools.partial(make_greedy_tiny_policy, str(tiny_model_path), MAX_NEW_TOKENS))
    yield collectors
    for c in collectors:
        c.shutdown()


@pytest.fixture(scope="module")
def small_collectors(ray_cluster):
    collectors = start_collectors(2, SmallModelPolicy)
    yield collectors
    for c in collectors:
        c.shutdown()





def remote_state(collector: RayLLMCollector) -> dict[str, torch.Tensor]:
    return collector.cascade_execute("policy.model.state_dict")


def same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def versions(collectors) -> list[int]:
    return [c.policy_version for c in collectors]


# ---------------------------------------------------------------------- the real tiny model
def test_outputs_after_a_push_match_a_fresh_model_with_the_new_weights(tiny_collectors, tiny_model_path) -> None:
    trainer = perturbed_model(tiny_model_path, seed=1)
    updater = RayRemoteWeightUpdater(trainer, tiny_collectors, config=PushConfig(timeout_s=60))
    before = versions(tiny_collectors)
    for c, v in zip(tiny_collectors, before):
        assert {int(t[keys.POLICY_VERSION]) for t in flatten_turns(c.next())} == {v}
    assert updater.push_weights() is None  # returns once every worker applied the weights
    # the push carries the version (one above the newest a worker held): the same on every worker
    assert versions(tiny_collectors) == [max(before) + 1] * 2 == [updater.version] * 2
    fresh, tokenizer = load_model_and_tokenizer(tiny_model_path)
    fresh.load_state_dict(trainer.state_dict())
    reference = TransformersPolicy(fresh, tokenizer, max_new_tokens=MAX_NEW_TOKENS, temperature=0)
    for c, v in zip(tiny_collectors, before):
        assert same_state(remote_state(c), trainer.state_dict())
        turns = flatten_turns(c.next())
        assert {int(t[keys.POLICY_VERSION]) for t in turns} == {updater.version}
        _, responses, log_probs = reference.generate([t[keys.TEXT_PROMPT] for t in turns])
        for turn, response, lp in zip(turns, responses, log_probs):
            assert torch.equal(turn[keys.TOKENS_RESPONSE], response)
            torch.testing.assert_close(turn[keys.LOG_PROBS_RESPONSE], lp)


def test_collector_property_setter_registers_and_pushes_to_all(tiny_collectors, tiny_model_path) -> None:
    trainer = perturbed_model(tiny_model_path, seed=2)
    updater = RayWeightUpdater(trainer, tiny_collectors)
    first = tiny_collectors[0]
    first.weight_updater = updater
    try:
        assert updater.collector is first and first.weight_updater is updater
        before = versions(tiny_collectors)
        first.update_policy_weights_()
        assert versions(tiny_collectors) == [max(before) + 1] * 2
        assert all(same_state(remote_state(c), trainer.state_dict()) for c in tiny_collectors)
    finally:
        first.weight_updater = None


def test_an_updater_without_collectors_serves_the_one_it_is_registered_with(small_collectors) -> None:
    collector, trainer = small_collectors[0], SmallNet()
    collector.weight_updater = RayRemoteWeightUpdater(trainer)
    try:
        assert collector.weight_updater.all_worker_ids() == [0]
        start = collector.policy_version
        collector.update_policy_weights_()
        assert collector.policy_version == start + 1
        assert same_state(remote_state(collector), trainer.state_dict())
    finally:
        collector.weight_updater = None


# ---------------------------------------------------------------------- skipping, targeting, waiting
def test_max_interval_skips_until_enough_pushes_were_missed(small_collectors) -> None:
    updater = RayRemoteWeightUpdater(SmallNet(), small_collectors, max_interval=2)
    start = versions(small_collectors)
    seen = []
    for _ in range(6):
        updater.push_weights()
        seen.append(versions(small_collectors))
    # skipped workers keep the version of the weights they hold; pushes 3 and 6 reach them
    b = max(start)
    assert seen == [start, start, [b + 3] * 2, [b + 3] * 2, [b + 3] * 2, [b + 6] * 2]
    with pytest.raises(ValueError, match="max_interval"):
        RayRemoteWeightUpdater(SmallNet(), small_collectors, max_interval=-1)


def test_worker_ids_are_bounds_checked_and_target_only_those(small_collectors) -> None:
    updater = RayRemoteWeightUpdater(SmallNet(), small_collectors)
    assert updater.all_worker_ids() == [0, 1]
    for bad in (2, [0, 2], -1, True):
        with pytest.raises(ValueError, match=r"unknown worker\(s\)"):
            updater.push_weights(worker_ids=bad)
    start = versions(small_collectors)
    updater.push_weights(worker_ids=[1])
    updater.push_weights(worker_ids=0)
    updater.push_weights(worker_ids=[1, 1])
    assert versions(small_collectors) == [max(start) + 2, max(start) + 3]  # each holds the push it got


def test_wait_false_returns_a_handle_and_runs_hooks_when_done(small_collectors) -> None:
    trainer = SmallNet()
    updater = RayRemoteWeightUpdater(trainer, small_collectors)
    hook_versions: list = []
    updater.register_post_hook(lambda: hook_versions.append(versions(small_collectors)))
    start = versions(small_collectors)
    handle = updater.push_weights(wait=False)
    assert isinstance(handle, PushHandle) and handle.worker_ids == [0, 1]
    handle.wait(timeout_s=30)
    assert handle.done()
    assert hook_versions == [[max(start) + 1] * 2]
    second = updater.push_weights(wait=False)
    updater.push_weights()  # waits for the push in flight first, so workers apply them in order
    assert second.done() and versions(small_collectors) == [max(start) + 3] * 2
    assert all(same_state(remote_state(c), trainer.state_dict()) for c in small_collectors)


# ---------------------------------------------------------------------- atomicity
@pytest.mark.parametrize(
    "spoil",
    [
        lambda w: w.pop("norm.bias"),
        lambda w: w.update(extra=torch.zeros(1)),
        lambda w: w.update({"norm.weight": torch.zeros(5)}),
        lambda w: w.update({"norm.weight": torch.zeros(8, dtype=torch.bfloat16)}),
    ],
    ids=["missing", "extra", "shape", "dtype"],
)
def test_a_bad_push_changes_nothing_on_any_worker(small_collectors, spoil) -> None:
    updater = RayRemoteWeightUpdater(None, small_collectors)
    states = [remote_state(c) for c in small_collectors]
    start = versions(small_collectors)
    weights = {k: torch.full_like(v, 3.0) for k, v in SmallNet().state_dict().items()}
    spoil(weights)
    with pytest.raises(ValueError, match="no weight was changed"):
        updater.push_weights(weights)
    assert versions(small_collectors) == start
    assert all(same_state(remote_state(c), s) for c, s in zip(small_collectors, states))


def test_worker_side_check_and_dtype_conversion(small_collectors) -> None:
    collector = small_collectors[0]
    weights = {k: v.double() for k, v in SmallNet().state_dict().items()}
    before, start = remote_state(collector), collector.policy_version
    with pytest.raises(ValueError, match="float64"):  # checked in the actor (no updater)
        collector.update_policy_weights_(weights)
    assert same_state(remote_state(collector), before) and collector.policy_version == start
    RayRemoteWeightUpdater(weights, [collector], config=PushConfig(convert_dtype=True, packing="flat")).push_weights()
    assert same_state(remote_state(collector), {k: v.float() for k, v in weights.items()})
    with pytest.raises(ValueError, match="only one"):
        collector.receive_weights(weights, policy=SmallNet())
    trainer = SmallNet()
    collector.receive_weights(policy=trainer)
    assert same_state(remote_state(collector), trainer.state_dict()) and collector.policy_version == start + 2


# ---------------------------------------------------------------------- faults
def test_a_dead_worker_fails_the_push_quickly(small_collectors) -> None:
    (doomed,) = start_collectors(1, SmallModelPolicy)
    updater = RayRemoteWeightUpdater(SmallNet(), [small_collectors[0], doomed], config=PushConfig(timeout_s=300))
    updater.init()  # metadata fetched while both are alive
    ray.kill(doomed.actor, no_restart=True)
    started = time.monotonic()
    with pytest.raises(WeightPushError, match="worker 1 died"):
        updater.push_weights()
    assert time.monotonic() - started < 150, "the push waited for its timeout instead of failing on the dead worker"
    doomed.shutdown(timeout=1)


def test_a_stuck_worker_times_out_instead_of_hanging(small_collectors) -> None:
    collector = small_collectors[1]
    collector.cascade_execute("policy.set_delay", 4.0)
    busy = collector.actor.collect_next.remote()  # holds the policy read lock for ~4 s per turn
    time.sleep(0.5)
    updater = RayRemoteWeightUpdater(SmallNet(), [collector], config=PushConfig(timeout_s=1.0))
    updater.init()
    with pytest.raises(WeightPushError, match=r"\[0\] did not apply the weights within timeout_s=1.0"):
        updater.push_weights()
    collector.cascade_execute("policy.set_delay", 0.0)
    ray.get(busy, timeout=60)


# ---------------------------------------------------------------------- schemes across processes
def test_object_store_scheme_pulls_the_newest_push(small_collectors) -> None:
    collector = small_collectors[0]
    sender = RayObjectStoreSender()
    collector.register_scheme_receiver({"critic": sender.make_receiver()}, synchronize_weights=False)
    start = collector.policy_version
    collector.receive_weights()
    assert collector.policy_version == start  # nothing published yet
    trainer = SmallNet()
    sender.send(trainer)
    sender.send(trainer)  # only the newest push is pulled
    collector.receive_weights()
    assert collector.policy_version == start + 1
    assert same_state(remote_state(collector), trainer.state_dict())
    sender.close()


def test_process_group_scheme_with_a_collector_actor(small_collectors) -> None:
    collector = small_collectors[1]
    sender = ProcessGroupSender(ProcessGroupConfig(num_receivers=1, backend="gloo", timeout_s=60))
    collector.register_scheme_receiver({"policy": ProcessGroupReceiver()}, synchronize_weights=False)
    collector.cascade_execute("_receiver_schemes['policy']._set_dist_connection_info", sender.connection_info(), worker_idx=0)
    joined = collector.actor.cascade_execute.remote("_receiver_schemes['policy'].connect")
    sender.connect()
    ray.get(joined, timeout=60)
    start = collector.policy_version
    trainer = SmallNet()
    pulled = collector.actor.receive_weights.remote()
    sender.send(trainer)
    ray.get(pulled, timeout=60)
    assert collector.policy_version == start + 1
    assert same_state(remote_state(collector), trainer.state_dict())
    sender.close()


def test_zero_copy_push_maps_the_object_and_a_copying_push_unshares(tiny_collectors, tiny_model_path) -> None:
    # packing="flat": one buffer per dtype, so a parameter mapped zero-copy sits at an offset in it
    def offset(c: RayLLMCollector) -> int:
        return c.cascade_execute("policy.model.model.norm.weight.storage_offset")

    trainer = perturbed_model(tiny_model_path, seed=3)
    updater = RayRemoteWeightUpdater(trainer, tiny_collectors, config=PushConfig(timeout_s=60, zero_copy=True, packing="flat"))
    updater.push_weights()
    fresh, tokenizer = load_model_and_tokenizer(tiny_model_path)
    fresh.load_state_dict(trainer.state_dict())
    reference = TransformersPolicy(fresh, tokenizer, max_new_tokens=MAX_NEW_TOKENS, temperature=0)
    for c in tiny_collectors:
        assert offset(c) > 0
        assert same_state(remote_state(c), trainer.state_dict())
        turns = flatten_turns(c.next())
        assert {int(t[keys.POLICY_VERSION]) for t in turns} == {updater.version}
        _, responses, _ = reference.generate([t[keys.TEXT_PROMPT] for t in turns])
        assert all(torch.equal(t[keys.TOKENS_RESPONSE], r) for t, r in zip(turns, responses))
    other = perturbed_model(tiny_model_path, seed=4)
    RayRemoteWeightUpdater(other, tiny_collectors, config=PushConfig(timeout_s=60)).push_weights()
    for c in tiny_collectors:
        assert offset(c) == 0
        assert same_state(remote_state(c), other.state_dict())


def test_a_lora_push_sends_only_the_adapter_and_every_worker_merges_it(tiny_collectors, tiny_model_path) -> None:
    """A peft model through RayRemoteWeightUpdater (with delta on): only the adapter's tensors go
    into the object store; each worker's engine merges them into its base; a bad adapter changes
    nothing anywhere; a later delta push still lands whole on workers whose held version moved on."""
    pytest.importorskip("peft")
    import dataclasses

    from lmcollect.weights.lora import lora_adapter
    from tests.factories import merged_copy, trained_lora

    base = perturbed_model(tiny_model_path, seed=7)
    updater = RayRemoteWeightUpdater(None, tiny_collectors, config=PushConfig(timeout_s=60, delta=True))
    updater.push_weights(base)  # a known base on every worker (the delta base too)
    peft_model = trained_lora(tiny_model_path, seed=31, base=perturbed_model(tiny_model_path, seed=7))
    adapter = lora_adapter(peft_model)
    updater.push_weights(peft_model)
    stats = updater.last_push_stats
    full_nbytes = sum(t.numel() * t.element_size() for t in base.state_dict().values())
    assert stats.kind == "lora" and stats.nbytes == adapter.nbytes < 0.05 * full_nbytes
    merged = merged_copy(peft_model).state_dict()
    for c in tiny_collectors:
        state = remote_state(c)
        for name, tensor in merged.items():
            torch.testing.assert_close(state[name], tensor, rtol=0, atol=1e-6, msg=name)
        assert {int(t[keys.POLICY_VERSION]) for t in flatten_turns(c.next())} == {updater.version}
    held, states = versions(tiny_collectors), [remote_state(c) for c in tiny_collectors]
    with pytest.raises(ValueError, match="rank 4 but the adapter's rank is 8"):
        updater.push_weights(dataclasses.replace(adapter, rank=8))
    assert versions(tiny_collectors) == held
    assert all(same_state(remote_state(c), s) for c, s in zip(tiny_collectors, states, strict=True))
    after = perturbed_model(tiny_model_path, seed=8)
    updater.push_weights(after)
    assert updater.last_push_stats.kind == "full"  # the workers no longer hold the delta base
    assert all(same_state(remote_state(c), after.state_dict()) for c in tiny_collectors)
