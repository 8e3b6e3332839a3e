"""vLLMUpdater pushing into real vLLM engines (CPU, tiny model): in-process, in a Ray collector, in engine actors.

Run with a Python that has vLLM: ``python -m pytest tests/integration/test_vllm_updater.py``. The
in-process engine is the session's (conftest); it gets its original weights back at the end.
"""
from __future__ import annotations

import functools
import time
from dataclasses import replace
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from tensordict import TensorDictBase, lazy_stack

from lmcollect.collectors.lockstep.collector import LLMCollector
from lmcollect.data import keys
from lmcollect.envs import ChatEnv, MathAnswerReward, arithmetic_dataset
from lmcollect.models import ModelSpec, get_model_path, load_model_and_tokenizer
from lmcollect.policies import TransformersPolicy
from lmcollect.testing import ScriptedPolicy
from lmcollect.weight_sync import WeightPushError
from lmcollect.weights.tensors import unique_targets
from tests.integration.conftest import CPU_ENGINE_KWARGS, MAX_NEW_TOKENS, QUESTIONS, chat_batch

pytest.importorskip("vllm")
from lmcollect.policies.vllm_policy import VLLMPolicy  # noqa: E402
from lmcollect.weight_sync.vllm_updater import VLLMUpdater, vLLMUpdater  # noqa: E402
from lmcollect.weight_sync import PushConfig  # noqa: E402
from lmcollect.engines.vllm.worker_ext import VLLM_EXTENSION  # noqa: E402

pytestmark = pytest.mark.integration

ATOL = 1e-4
EXT_ENGINE_KWARGS = {**CPU_ENGINE_KWARGS, "worker_extension_cls": VLLM_EXTENSION}
# a prompt spanning several KV blocks: after a push its cached prefix must not be reused
LONG_SYSTEM_PROMPT = " ".join(f"Rule {i}: answer with digits only." for i in range(60))


@pytest.fixture(scope="module")
def new_model(model_dir: Path, tiny_model_path: Path) -> torch.nn.Module:
    """The session model's architecture (and eos config) with other weights: the tiny model of seed 1."""
    model = load_model_and_tokenizer(model_dir)[0]
    seed1 = get_model_path(ModelSpec(size="tiny", seed=1), cache_dir=tiny_model_path.parent)
    model.load_state_dict(load_model_and_tokenizer(seed1)[0].state_dict())
    return model


@pytest.fixture(scope="module")
def new_reference(new_model: torch.nn.Module, model_dir: Path) -> TransformersPolicy:
    tokenizer = load_model_and_tokenizer(model_dir)[1]
    return TransformersPolicy(new_model, tokenizer, temperature=0.0, max_new_tokens=MAX_NEW_TOKENS)


@pytest.fixture(scope="module")
def old_reference(model_dir: Path) -> TransformersPolicy:
    model, tokenizer = load_model_and_tokenizer(model_dir)
    return TransformersPolicy(model, tokenizer, temperature=0.0, max_new_tokens=MAX_NEW_TOKENS)


@pytest.fixture(scope="module")
def local_engine(greedy_policy: VLLMPolicy, old_reference: TransformersPolicy) -> Iterator[VLLMPolicy]:
    """The session's in-process engine; its original weights are pushed back afterwards."""
    yield greedy_policy
    vLLMUpdater.from_policy(greedy_policy).push_weights(old_reference.model)


def make_env(num_items: int = 32) -> ChatEnv:
    return ChatEnv(arithmetic_dataset(num_items, seed=0), reward_fn=MathAnswerReward(), batch_size=4, seed=0)


def assert_same_answers(got: TensorDictBase, want: TensorDictBase) -> None:
    for i in range(want.batch_size[0]):
        assert torch.equal(got[i][keys.TOKENS_FULL], want[i][keys.TOKENS_FULL]), f"element {i}"
        torch.testing.assert_close(got[i][keys.LOG_PROBS_RESPONSE], want[i][keys.LOG_PROBS_RESPONSE], atol=ATOL, rtol=0)


def prompts_of_batch(batch: TensorDictBase) -> TensorDictBase:
    turns = batch.reshape(-1)
    return lazy_stack([turns[i].select(keys.HISTORY_PROMPT) for i in range(turns.numel())])


# ------------------------------------------------------------------------------------ construction
def test_constructor_defaults_and_policy_lookup(greedy_policy: VLLMPolicy) -> None:
    updater = vLLMUpdater()
    assert VLLMUpdater is vLLMUpdater
    assert (updater.master_address, updater.master_port, updater.vllm_tp_size) == (None, None, 1)  # None: chosen at init
    assert updater.all_worker_ids() == [0] and updater.collector is None
    assert vLLMUpdater.from_policy(ScriptedPolicy("1")) is None
    assert isinstance(vLLMUpdater.from_policy(greedy_policy), vLLMUpdater)
    metadata = vLLMUpdater.get_model_metadata(greedy_policy)
    assert metadata["model.norm.weight"][0] == torch.float32 and "model.embed_tokens.weight" in metadata
    with pytest.raises(ValueError, match="vllm_tp_size"):
        vLLMUpdater(vllm_tp_size=0)


# ------------------------------------------------------------------------------------ in-process engine
def test_push_matches_transformers_resets_cache_and_bumps_version(
    local_engine: VLLMPolicy,
    new_model: torch.nn.Module,
    old_reference: TransformersPolicy,
    new_reference: TransformersPolicy,
) -> None:
    updater = vLLMUpdater(config=PushConfig(verify=True, timeout_s=60))
    collector = LLMCollector(
        make_env(), policy=local_engine, dialog_turns_per_batch=4, weight_updater=updater, track_policy_version=True
    )
    v0 = collector.policy_version  # counts on from the session engine's version (earlier tests pushed into it)
    assert v0 == max(local_engine.engine.version, 0)
    assert updater.collector is collector
    td = chat_batch(QUESTIONS)
    updater.init()
    assert updater._sender is not None and updater._sender.connection_info()["master_address"] == "127.0.0.1"
    long_td = chat_batch(QUESTIONS[:2], system_prompt=LONG_SYSTEM_PROMPT)
    assert_same_answers(local_engine(long_td), old_reference(long_td))  # fills the prefix cache
    assert collector.policy_version == v0

    collector.update_policy_weights_(new_model)  # a whole state_dict (tied lm_head named too)
    assert collector.policy_version == v0 + 1
    (info,) = updater.last_push_info  # one worker (tp 1), which checked the buckets' checksums
    assert info["rank"] == 1 and len(info["checksums"]) >= 1
    assert_same_answers(local_engine(long_td), new_reference(long_td))  # the new model's answer: cache reset
    assert_same_answers(local_engine(td), new_reference(td))
    batch = collector.next().reshape(-1)
    assert batch[keys.POLICY_VERSION].tolist() == [v0 + 1] * batch.numel()

    updater.push_weights(unique_targets(old_reference.model)[0])  # distinct tensors only: lm_head rebuilt
    assert collector.policy_version == v0 + 2
    assert_same_answers(local_engine(td), old_reference(td))
    collector.shutdown()


def test_update_policy_weights_without_an_updater_loads_into_the_workers(
    local_engine: VLLMPolicy,
    new_model: torch.nn.Module,
    old_reference: TransformersPolicy,
    new_reference: TransformersPolicy,
) -> None:
    """As on a ContinuousLLMCollector over VLLMEngine: the weights travel in the call, checked by the workers."""
    collector = LLMCollector(make_env(), policy=local_engine, dialog_turns_per_batch=4, track_policy_version=True)
    v0 = collector.policy_version  # the session engine's version
    td = chat_batch(QUESTIONS)
    collector.update_policy_weights_(new_model.state_dict())
    assert collector.policy_version == v0 + 1
    assert_same_answers(local_engine(td), new_reference(td))
    wrong_shape = {**new_model.state_dict(), "model.norm.weight": torch.zeros(3)}
    with pytest.raises(ValueError, match="model.norm.weight"):
        collector.update_policy_weights_(wrong_shape)
    assert collector.policy_version == v0 + 1
    assert_same_answers(local_engine(td), new_reference(td))  # the refused push changed nothing
    collector.update_policy_weights_(old_reference.model.state_dict())
    assert collector.policy_version == v0 + 2
    assert_same_answers(local_engine(td), old_reference(td))
    collector.shutdown()


def test_bad_pushes_change_nothing(
    local_engine: VLLMPolicy, new_model: torch.nn.Module, old_reference: TransformersPolicy
) -> None:
    updater = vLLMUpdater(config=PushConfig(timeout_s=60))
    collector = LLMCollector(
        make_env(), policy=local_engine, dialog_turns_per_batch=4, weight_updater=updater, track_policy_version=True
    )
    v0 = collector.policy_version  # the session engine's version
    td = chat_batch(QUESTIONS[:2])
    updater.push_weights(old_reference.model)  # forms the group; a known starting point
    state = dict(new_model.state_dict())
    bad_pushes = {
        "missing 'model.norm.weight'": {k: v for k, v in state.items() if k != "model.norm.weight"},
        "unexpected 'extra.weight'": {**state, "extra.weight": torch.zeros(2)},
        "has shape": {**state, "model.norm.weight": torch.zeros(3)},
        "has dtype": {**state, "model.norm.weight": state["model.norm.weight"].double()},
    }
    for match, weights in bad_pushes.items():
        with pytest.raises(ValueError, match=match):
            collector.update_policy_weights_(weights)
    assert collector.policy_version == v0 + 1
    assert_same_answers(local_engine(td), old_reference(td))
    with pytest.raises(ValueError, match="worker_ids"):
        updater.push_weights(state, worker_ids=[1])
    updater.push_weights(old_reference.model)  # the group is still in step after the refusals
    assert collector.policy_version == v0 + 2
    collector.shutdown()


# ------------------------------------------------------------------------------------ Ray
def wait_until(condition: Any, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def turns_of_version(buffer: Any, version: int) -> TensorDictBase:
    turns = buffer.sample(len(buffer), replace=False)
    return turns[(turns[keys.POLICY_VERSION] == version).reshape(-1)]


def test_ray_collector_with_vllm_policy_collects_in_the_background_through_a_push(
    ray_cluster: Any, model_dir: Path, new_model: torch.nn.Module, new_reference: TransformersPolicy,
    old_reference: TransformersPolicy,
) -> None:
    """The engine in the collector's actor, the actor's default concurrency: start() collects on the
    actor's collection thread while the push arrives on a control thread; both reach the engine."""
    from lmcollect.ray import RayReplayBuffer
    from lmcollect.ray.collector import RayLLMCollector

    policy_factory = functools.partial(
        VLLMPolicy, str(model_dir), engine_kwargs=EXT_ENGINE_KWARGS, temperature=0.0, max_new_tokens=MAX_NEW_TOKENS
    )
    buffer = RayReplayBuffer(capacity=1000)
    updater = vLLMUpdater(config=PushConfig(timeout_s=120, verify=True))
    collector = RayLLMCollector(
        make_env(),
        policy_factory=policy_factory,
        dialog_turns_per_batch=4,
        replay_buffer=buffer,
        weight_updater=updater,
        track_policy_version=True,
        remote_config={"runtime_env": {"env_vars": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}}},  # engine in the actor
    )
    try:
        collector.start()
        wait_until(lambda: len(buffer) >= 4)
        collector.update_policy_weights_(new_model)  # while the actor collects
        assert collector.policy_version == 1
        assert updater._sender is not None and updater._sender.connection_info()["master_address"] == "127.0.0.1"
        wait_until(lambda: turns_of_version(buffer, 1).numel() >= 4)
        assert collector.is_running()  # re-raises a failure of the actor's collection thread
        old, new = turns_of_version(buffer, 0), turns_of_version(buffer, 1)
    finally:
        collector.shutdown()
        buffer.shutdown()
    # every turn was generated entirely under the weights its version names
    assert_same_answers(old, old_reference(prompts_of_batch(old)))
    assert_same_answers(new, new_reference(prompts_of_batch(new)))


def test_convert_dtype_pushes_into_a_bf16_engine_actor_and_a_killed_actor_fails_within_timeout(
    ray_cluster: Any, model_dir: Path, new_model: torch.nn.Module, old_reference: TransformersPolicy
) -> None:
    """Refused without convert_dtype; with it, new fp32 weights go out as bf16 (half the bytes) and
    take effect, and pushing the checkpoint's own fp32 weights back gives the engine's start-up
    answers exactly (the same bf16 rounding as vLLM's own load). The engine is an actor (one
    in-process engine per process) behind a local collector; killed at the end, the next push
    fails within the updater's timeout, naming the replica, and the version stays."""
    import ray

    from lmcollect.ray.vllm_replicas import VLLMReplicas

    bf16_kwargs = {**EXT_ENGINE_KWARGS, "dtype": "bfloat16"}
    engine = VLLMReplicas(model_dir, engine_kwargs=bf16_kwargs, remote_config={"num_cpus": 0.5})
    pushed = VLLMPolicy(model_dir, engine=engine, temperature=0.0, max_new_tokens=MAX_NEW_TOKENS)
    timeout_s = 20.0
    updater = vLLMUpdater(config=PushConfig(timeout_s=timeout_s, verify=True, convert_dtype=True))
    collector = LLMCollector(
        make_env(), policy=pushed, dialog_turns_per_batch=4, weight_updater=updater, track_policy_version=True
    )
    td = chat_batch(QUESTIONS)
    try:
        at_start = pushed(td)
        refused = vLLMUpdater.from_policy(pushed)
        with pytest.raises(ValueError, match=r"has dtype torch.float32, the model expects torch.bfloat16 \(pass convert_dtype=True"):
            refused.push_weights(new_model)
        refused.close()
        assert_same_answers(pushed(td), at_start)  # the refused push changed nothing
        collector.update_policy_weights_(new_model)
        assert collector.policy_version == 1
        sent_bytes = sum(buffer.numel() for buffer in updater._sender._sent)  # bf16 on the wire: half of fp32
        assert sent_bytes < 0.6 * sum(t.numel() * 4 for t in unique_targets(new_model)[0].values())
        changed = pushed(td)
        assert any(not torch.equal(changed[i][keys.TOKENS_FULL], at_start[i][keys.TOKENS_FULL]) for i in range(len(QUESTIONS)))
        collector.update_policy_weights_(old_reference.model)  # the checkpoint's fp32 weights, cast again
        assert collector.policy_version == 2
        back = pushed(td)
        for i in range(len(QUESTIONS)):
            assert torch.equal(back[i][keys.TOKENS_FULL], at_start[i][keys.TOKENS_FULL]), f"element {i}"
            torch.testing.assert_close(back[i][keys.LOG_PROBS_RESPONSE], at_start[i][keys.LOG_PROBS_RESPONSE], atol=1e-3, rtol=0)
        ray.kill(engine.actors[0])
        start = time.monotonic()
        with pytest.raises(WeightPushError, match="replica 0"):
            collector.update_policy_weights_(new_model)
        assert time.monotonic() - start < timeout_s + 5
        assert collector.policy_version == 2
    finally:
        collector.shutdown()
        engine.shutdown()


# ------------------------------------------------------------------------------------ GPU only
@pytest.mark.gpu
def test_nccl_push_into_tensor_parallel_engine(ray_cluster: Any, model_dir: Path, new_model: torch.nn.Module) -> None:
    """NCCL from a CUDA trainer into a tp=2 engine actor: the trainer and each worker need a GPU of their own."""
    if torch.cuda.device_count() < 3:
        pytest.skip("NCCL into a tp=2 engine needs 3 GPUs (trainer + 2 workers; NCCL refuses shared devices)")
    from lmcollect.ray.vllm_replicas import VLLMReplicas

    gpu_kwargs = {"worker_extension_cls": VLLM_EXTENSION, "tensor_parallel_size": 2, "enforce_eager": True}
    replicas = VLLMReplicas(model_dir, engine_kwargs=gpu_kwargs, remote_config={"num_cpus": 0.5, "num_gpus": 2})
    policy = VLLMPolicy(model_dir, engine=replicas, temperature=0.0, max_new_tokens=MAX_NEW_TOKENS)
    updater = vLLMUpdater.from_policy(policy)
    updater.config = replace(updater.config, vllm_tp_size=2)
    trainer_model = new_model.to("cuda:0")
    try:
        updater.push_weights(trainer_model)
        assert updater._sender is not None and updater._sender.backend == "nccl"
        assert len(updater.last_push_info) == 2
        td = chat_batch(QUESTIONS)
        reference = TransformersPolicy(trainer_model, policy.tokenizer, temperature=0.0, max_new_tokens=MAX_NEW_TOKENS)
        want = reference(td)
        for i in range(len(QUESTIONS)):  # GPU kernels differ: compare the first tokens only
            assert torch.equal(policy(td)[i][keys.TOKENS_RESPONSE][:4], want[i][keys.TOKENS_RESPONSE][:4])
    finally:
        new_model.to("cpu")
        replicas.shutdown()
