"""VLLMEngine (vLLM's LLMEngine stepped by our decoding thread, in this process) on the tiny model.

The engine is the session's in-process one (``greedy_policy.engine`` in conftest, which the other
in-process vLLM files share): every test that pushes puts the original weights back, and the last
test, ``close``, closes it (this file runs last in that group: ``SLOWEST_FIRST`` in tests/conftest.py).
Skipped where vLLM is not installed.
"""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from tensordict import TensorDictBase

from lmcollect.collectors import ContinuousLLMCollector, LLMCollector
from lmcollect.data import keys
from lmcollect.data.turns import flatten_turns, non_tensor_values
from lmcollect.envs import ChatEnv, GuessingGameTask, SingleTurnTask, arithmetic_dataset, guessing_game_dataset
from lmcollect.engines import EngineProtocol, EngineRequest, EngineResult, WorkerRpcEngine
from lmcollect.engines.protocol import PromptTooLongError
from lmcollect.models import load_model_and_tokenizer
from lmcollect.engines.sampling import SamplingConfig
from lmcollect.engines.vllm.common import checkpoint_eos_token_ids
from lmcollect.weight_sync import PushConfig, vLLMUpdater
from tests.engine_contract import CHECKS, EngineCase, generate_greedy, hf_case
from tests.factories import corrupted_delta, perturbed_model, run_in_thread, sparsely_trained
from tests.integration.conftest import MAX_NEW_TOKENS, QUESTIONS, chat_batch
from tests.vllm_hold import held_step

pytest.importorskip("vllm")
from lmcollect.engines.vllm.engine import VLLMEngine  # noqa: E402

pytestmark = pytest.mark.integration

ATOL = 1e-4
RESULT_TIMEOUT_S = 120.0
LONG_RESPONSE_TOKENS = 300  # long enough to be mid-generation when the pause comes


@pytest.fixture
def engine(greedy_policy: Any) -> VLLMEngine:
    return greedy_policy.engine


@pytest.fixture(scope="module")
def hf_model(model_dir: Path) -> torch.nn.Module:
    return load_model_and_tokenizer(model_dir)[0].eval()


@pytest.fixture(scope="module")
def sync_answers(greedy_policy: Any) -> TensorDictBase:
    """The lockstep policy's greedy answers to QUESTIONS (QUESTIONS[0] stops at an eos)."""
    return greedy_policy(chat_batch(QUESTIONS))


def test_one_in_process_engine_with_worker_rpcs(engine: VLLMEngine) -> None:
    assert isinstance(engine, EngineProtocol) and isinstance(engine, WorkerRpcEngine)
    assert engine.num_replicas == 1
    with pytest.raises(ValueError, match="one replica"):
        engine.collective_rpc_each("hold_forward", [(), ()])
    with pytest.raises(TypeError, match="version must be an int"):
        engine.set_version("3")  # type: ignore[arg-type]
    context = engine._max_model_len  # vLLM's max_model_len: a prompt must leave room for one token
    with pytest.raises(PromptTooLongError, match=rf"the prompt has {context} tokens, .* context of {context} tokens"):
        engine.submit(EngineRequest(prompt_ids=[1] * context, sampling=greedy(1)))


def greedy(max_new_tokens: int = MAX_NEW_TOKENS, **options: Any) -> SamplingConfig:
    return SamplingConfig(temperature=0.0, max_new_tokens=max_new_tokens, **options)


def prompt_of(answers: TensorDictBase, i: int) -> list[int]:
    return answers[i][keys.TOKENS_PROMPT].tolist()


@torch.no_grad()
def forward_logits(model: torch.nn.Module, prompt_ids: list[int], tokens: torch.Tensor) -> torch.Tensor:
    """fp32 logits that predicted each of ``tokens`` after ``prompt_ids`` (one forward pass)."""
    ids = torch.tensor([prompt_ids + tokens.tolist()])
    return model(ids).logits[0, len(prompt_ids) - 1 : -1].float()


def forward_log_probs(model: torch.nn.Module, prompt_ids: list[int], tokens: torch.Tensor) -> torch.Tensor:
    log_probs = torch.log_softmax(forward_logits(model, prompt_ids, tokens), dim=-1)
    return log_probs.gather(1, tokens[:, None])[:, 0]


def answer(engine: VLLMEngine, prompt_ids: list[int], sampling: SamplingConfig, **fields: Any) -> EngineResult:
    return engine.submit(EngineRequest(prompt_ids=prompt_ids, sampling=sampling, **fields)).result(RESULT_TIMEOUT_S)


# ------------------------------------------------------------------------------------ generation
def test_concurrent_submits_equal_the_lockstep_policy(engine: VLLMEngine, sync_answers: TensorDictBase) -> None:
    assert isinstance(engine, EngineProtocol)
    futures = [
        engine.submit(EngineRequest(prompt_ids=prompt_of(sync_answers, i), sampling=greedy(), request_id=f"q{i}"))
        for i in range(len(QUESTIONS))
    ]
    results = [f.result(RESULT_TIMEOUT_S) for f in futures]
    for i, result in enumerate(results):
        assert torch.equal(result.tokens, sync_answers[i][keys.TOKENS_RESPONSE]), f"question {i}"
        torch.testing.assert_close(result.log_probs, sync_answers[i][keys.LOG_PROBS_RESPONSE], atol=ATOL, rtol=0)
        assert result.tokens.dtype == torch.long and result.log_probs.dtype == torch.float32
        assert torch.equal(result.token_versions, torch.full_like(result.tokens, engine.version))
    assert results[0].finish_reason == "stop" and len(results[0].tokens) < MAX_NEW_TOKENS  # the extra eos, kept
    assert all(r.finish_reason == "length" and len(r.tokens) == MAX_NEW_TOKENS for r in results[1:])
    assert engine.num_in_flight == 0


def test_log_probs_equal_a_transformers_forward_pass(
    engine: VLLMEngine, sync_answers: TensorDictBase, hf_model: torch.nn.Module
) -> None:
    sampled = SamplingConfig(temperature=1.0, max_new_tokens=MAX_NEW_TOKENS)
    for i in range(len(QUESTIONS)):
        prompt = prompt_of(sync_answers, i)
        for result in (answer(engine, prompt, greedy()), answer(engine, prompt, sampled, seed=i)):
            want = forward_log_probs(hf_model, prompt, result.tokens)
            torch.testing.assert_close(result.log_probs, want, atol=ATOL, rtol=0)


def test_seeds_and_stop_token_ids(engine: VLLMEngine, sync_answers: TensorDictBase) -> None:
    prompt = prompt_of(sync_answers, 1)
    sampled = SamplingConfig(temperature=1.0, max_new_tokens=16)
    first, again = (answer(engine, prompt, sampled, seed=7) for _ in range(2))
    assert torch.equal(first.tokens, again.tokens)
    others = [answer(engine, prompt, sampled, seed=s).tokens for s in (8, 9, 10)]
    assert any(not torch.equal(first.tokens, o) for o in others), "the seed does not reach the sampler"

    full = answer(engine, prompt, greedy(ignore_eos=True))
    stop_id = int(full.tokens[5])
    end = full.tokens.tolist().index(stop_id) + 1
    stopped = answer(engine, prompt, greedy(ignore_eos=True), stop_token_ids=(stop_id,))
    assert stopped.finish_reason == "stop" and torch.equal(stopped.tokens, full.tokens[:end])  # stop token kept

    with pytest.raises(ValueError, match="stop_strings"):
        engine.submit(EngineRequest(prompt_ids=prompt, sampling=greedy(stop_strings=("x",))))
    with pytest.raises(ValueError, match="sampled_log_probs"):
        engine.submit(EngineRequest(prompt_ids=prompt, sampling=greedy(sampled_log_probs=True)))
    with pytest.raises(ValueError, match="prompt_ids"):
        engine.submit(EngineRequest(prompt_ids=[], sampling=greedy()))


def test_seeded_prompts_longer_than_a_step_budget_do_not_kill_the_engine(engine: VLLMEngine) -> None:
    # vLLM rewinds a seeded request's generator by an offset after each prefill chunk, which a CPU
    # generator does not have: with chunked prefill this batch killed the engine core (whole prefills here)
    sampled = SamplingConfig(temperature=1.0, max_new_tokens=4)
    long_prompt = [int(t) for t in torch.randint(10, 200, (1500,), generator=torch.Generator().manual_seed(0))]
    futures = [engine.submit(EngineRequest(prompt_ids=long_prompt, sampling=sampled, seed=s)) for s in range(3)]
    results = [f.result(RESULT_TIMEOUT_S) for f in futures]  # 4500 prompt tokens: more than 2048 per step
    assert all(len(r.tokens) == 4 for r in results)
    assert torch.equal(results[0].tokens, answer(engine, long_prompt, sampled, seed=0).tokens)  # the seed holds


# ------------------------------------------------------------------------------------ weights
def test_load_during_a_pause_switches_in_flight_tokens_to_the_new_weights(
    engine: VLLMEngine, sync_answers: TensorDictBase, hf_model: torch.nn.Module, model_dir: Path
) -> None:
    new_model = perturbed_model(model_dir, seed=1).eval()
    prompt = prompt_of(sync_answers, 1)
    old_version = engine.version
    long = engine.submit(
        EngineRequest(prompt_ids=prompt, sampling=greedy(LONG_RESPONSE_TOKENS, ignore_eos=True), request_id="long")
    )
    # a later request of 8 tokens finishing means the long one has at least 8 tokens too
    answer(engine, prompt_of(sync_answers, 2), greedy(8, ignore_eos=True))
    try:
        engine.pause()
        assert not long.done() and engine.num_in_flight == 1 and engine.paused
        engine.load_weights(new_model.state_dict().items(), version=old_version + 1)
        assert engine.version == old_version + 1 and not long.done()
        engine.reset_prefix_cache()
        engine.resume()
        result = long.result(RESULT_TIMEOUT_S)
    finally:
        engine.load_weights(hf_model.state_dict().items(), version=old_version + 2)  # the next tests' weights
        if engine.paused:
            engine.resume()

    assert len(result.tokens) == LONG_RESPONSE_TOKENS  # the pause lost no token
    switch = int((result.token_versions == old_version).sum())
    assert 8 <= switch < LONG_RESPONSE_TOKENS
    assert torch.equal(result.token_versions[:switch], torch.full((switch,), old_version))
    assert torch.equal(result.token_versions[switch:], torch.full((LONG_RESPONSE_TOKENS - switch,), old_version + 1))
    # each segment's log-probs are those of a forward pass under the weights its version names
    old_segment = forward_log_probs(hf_model, prompt, result.tokens)[:switch]
    new_logits = forward_logits(new_model, prompt, result.tokens)[switch:]
    new_segment = torch.log_softmax(new_logits, dim=-1).gather(1, result.tokens[switch:, None])[:, 0]
    torch.testing.assert_close(result.log_probs[:switch], old_segment, atol=ATOL, rtol=0)
    torch.testing.assert_close(result.log_probs[switch:], new_segment, atol=ATOL, rtol=0)
    assert torch.equal(result.tokens[switch:], new_logits.argmax(dim=-1))  # greedy under the new weights
    not_old = forward_log_probs(hf_model, prompt, result.tokens)[switch:]
    assert (result.log_probs[switch:] - not_old).abs().max() > 1e-2  # the check can tell the weights apart
    # the pushes went straight into the parameters (vllm_direct_load): the checks above are of that path
    loaders = engine.run_on_engine(lambda llm: llm.collective_rpc(lambda worker: worker._lmcollect_direct))
    assert [type(loader).__name__ for loader in loaders] == ["DirectLoad"], loaders
    assert loaders[0].kept_bytes > 0, "on CPU the linear layers' weights are kept for the next push"


def test_bad_loads_are_refused_and_change_nothing(
    engine: VLLMEngine, sync_answers: TensorDictBase, hf_model: torch.nn.Module
) -> None:
    prompt = prompt_of(sync_answers, 2)
    before = answer(engine, prompt, greedy())
    version = engine.version
    state = dict(hf_model.state_dict())
    noisy = {name: t + 1.0 for name, t in state.items()}  # would change every answer if any got through
    bad_loads = {
        "missing 'model.norm.weight'": {k: v for k, v in noisy.items() if k != "model.norm.weight"},
        "unexpected 'extra.weight'": {**noisy, "extra.weight": torch.zeros(2)},
        "has shape": {**noisy, "model.norm.weight": torch.zeros(3)},
        "has dtype": {**noisy, "model.norm.weight": noisy["model.norm.weight"].double()},
    }
    for match, weights in bad_loads.items():
        with pytest.raises(ValueError, match=match):
            engine.load_weights(weights.items(), version=version + 1)
    with pytest.raises(TypeError, match="version"):
        engine.load_weights(state.items(), version="1")  # type: ignore[arg-type]
    assert engine.version == version and not engine.paused
    after = answer(engine, prompt, greedy())
    assert torch.equal(after.tokens, before.tokens) and torch.equal(after.log_probs, before.log_probs)

    # a load while running pauses around itself; the same weights answer the same
    engine.load_weights(state.items(), version=version + 1)
    assert engine.version == version + 1 and not engine.paused
    again = answer(engine, prompt, greedy())
    assert torch.equal(again.tokens, before.tokens)
    assert torch.equal(again.token_versions, torch.full_like(again.tokens, version + 1))


# ---------------------------------------------------------------------- continuous collection over it
def guessing_env(seed: int = 0) -> ChatEnv:
    return ChatEnv(guessing_game_dataset(16, seed=0), task=GuessingGameTask(), batch_size=1, max_turns=4, seed=seed)


def test_greedy_turns_equal_the_lockstep_collectors(engine, greedy_policy) -> None:
    sync = LLMCollector(guessing_env(), policy=greedy_policy, dialog_turns_per_batch=6, flatten_data=True)
    cont = ContinuousLLMCollector(
        [guessing_env()], engine=engine, tokenizer=greedy_policy.tokenizer,
        sampling=greedy_policy.sampling, stop_token_ids=greedy_policy.stop_token_ids, dialog_turns_per_batch=6,
    )
    with cont:
        got = flatten_turns(cont.next())
    expected = flatten_turns(sync.next())
    assert max(int(t[keys.STEP_COUNT]) for t in got) >= 1  # multi-turn: later prompts extend earlier tokens
    for mine, theirs in zip(got, expected):
        for key in (keys.TOKENS_PROMPT, keys.TOKENS_RESPONSE, keys.TOKENS_FULL):
            assert torch.equal(mine.get(key), theirs.get(key)), key
        torch.testing.assert_close(mine.get(keys.LOG_PROBS_RESPONSE), theirs.get(keys.LOG_PROBS_RESPONSE), atol=1e-4, rtol=0)
        assert non_tensor_values(mine, keys.HISTORY_FULL) == non_tensor_values(theirs, keys.HISTORY_FULL)


def _forward_log_probs(model, full: torch.Tensor, num_prompt: int) -> torch.Tensor:
    with torch.no_grad():
        logits = model(full.unsqueeze(0)).logits[0].float()
    return torch.log_softmax(logits, -1)[num_prompt - 1 : -1].gather(1, full[num_prompt:, None])[:, 0]


@pytest.mark.parametrize("push", ["object store", "process group"])
def test_a_push_mid_turn_is_recorded_per_token(engine, model_dir, greedy_policy, push) -> None:
    """Either updater lands mid-turn: receive_weights (load_weights), or vLLMUpdater broadcasting
    straight into the engine's workers through the WorkerRpcEngine interface while it is paused."""
    old, _ = load_model_and_tokenizer(model_dir)
    new = perturbed_model(model_dir, seed=5)
    env = ChatEnv(arithmetic_dataset(8, seed=0), task=SingleTurnTask(), batch_size=1, seed=0)
    updater = vLLMUpdater(config=PushConfig(timeout_s=60, verify=True)) if push == "process group" else None
    collector = ContinuousLLMCollector(
        [env], engine=engine, tokenizer=greedy_policy.tokenizer, dialog_turns_per_batch=1, track_policy_version=True,
        sampling=SamplingConfig(max_new_tokens=300, temperature=0, ignore_eos=True), weight_updater=updater,
    )
    try:
        join = run_in_thread(collector.next, timeout_s=180)
        deadline = time.monotonic() + 60
        while engine.num_in_flight == 0:
            assert time.monotonic() < deadline, "the turn never started"
            time.sleep(0.01)
        time.sleep(0.2)
        collector.update_policy_weights_(new)  # lands while the 300-token turn runs
        if updater is not None:  # the workers' reports came back through the collector, checksums compared
            assert updater.last_push_info and all("checksums" in info for info in updater.last_push_info)
        turn = flatten_turns(join())[0]
        assert engine.version == collector.version_index()
    finally:
        collector.shutdown()
        if updater is not None:
            updater.close()
        engine.load_weights(old.state_dict().items(), version=engine.version + 1)  # as before
    versions = turn.get(keys.TOKEN_VERSIONS)
    assert versions[0] < versions[-1] and set(versions.tolist()) == {int(versions[0]), int(versions[-1])}
    full, num_prompt = turn.get(keys.TOKENS_FULL), turn.get(keys.TOKENS_PROMPT).numel()
    stored = turn.get(keys.LOG_PROBS_RESPONSE)
    for model, version in ((old, int(versions[0])), (new, int(versions[-1]))):
        segment = versions == version
        torch.testing.assert_close(stored[segment], _forward_log_probs(model, full, num_prompt)[segment], atol=1e-4, rtol=0)


def test_a_bare_engine_takes_process_group_pushes(engine, model_dir, hf_model) -> None:
    """vLLMUpdater.from_policy(engine): no collector; the push pauses the engine, labels the version."""
    new = perturbed_model(model_dir, seed=6)
    updater = vLLMUpdater.from_policy(engine)
    assert updater is not None
    prompt = [1, 2, 3, 4]
    try:
        updater.push_weights(new)
        result = answer(engine, prompt, greedy(8))
        assert int(result.token_versions[0]) == engine.version == updater.version
        torch.testing.assert_close(
            result.log_probs, forward_log_probs(new, prompt, result.tokens), atol=ATOL, rtol=0
        )
    finally:
        updater.close()
        engine.load_weights(hf_model.state_dict().items(), version=engine.version + 1)


def test_lora_adapters_merge_in_the_workers_as_in_the_merged_model(engine, model_dir, hf_model) -> None:
    """An adapter through the engine, then another (other layers) through vLLMUpdater: each answers
    greedily and with the log-probs of its merged model; a misshapen one changes nothing; a full
    push afterwards is the base again."""
    pytest.importorskip("peft")
    from lmcollect.weights.lora import lora_adapter
    from tests.factories import merged_copy, trained_lora

    base = load_model_and_tokenizer(model_dir)[0].eval()
    peft_qv = trained_lora(model_dir, seed=21, base=base)
    peft_o = trained_lora(model_dir, seed=22, targets=("o_proj",), base=load_model_and_tokenizer(model_dir)[0].eval())
    prompt = [1, 2, 3, 4, 5]
    updater = vLLMUpdater.from_policy(engine)
    assert updater is not None
    try:
        reports = engine.load_weights(lora_adapter(peft_qv), version=engine.version + 1)
        assert reports and all(report["num_tensors"] > 0 for report in reports)
        expect_answers_of(merged_copy(peft_qv), engine, prompt)
        updater.push_weights(peft_o)  # q/v go back to the base, o_proj adapted
        assert updater.last_push_stats.kind == "lora" and updater.last_push_stats.nbytes == lora_adapter(peft_o).nbytes
        expect_answers_of(merged_copy(peft_o), engine, prompt)
        held = engine.version
        bad = lora_adapter(trained_lora(model_dir, seed=23, rank=8, steps=0, base=load_model_and_tokenizer(model_dir)[0]))
        with pytest.raises(ValueError, match="rank 8|do not fit"):
            engine.load_weights(dataclasses.replace(bad, rank=4), version=held + 1)
        assert engine.version == held
        expect_answers_of(merged_copy(peft_o), engine, prompt)
    finally:
        updater.close()
        engine.load_weights(hf_model.state_dict().items(), version=engine.version + 1)
    expect_answers_of(hf_model, engine, prompt)


def test_a_refused_full_push_leaves_the_workers_base_as_it_was(engine, model_dir, hf_model) -> None:
    """The engine packs full pushes into two buffer sets in turn (the worker keeps the last push's as
    its base): a push refused after packing (here a stale version) must not touch the base that a
    LoRA adapter then merges into."""
    pytest.importorskip("peft")
    from lmcollect.engines import StalePushError
    from lmcollect.weights.lora import lora_adapter
    from tests.factories import merged_copy, trained_lora

    new, other = perturbed_model(model_dir, seed=51).eval(), perturbed_model(model_dir, seed=52).eval()
    adapted = trained_lora(model_dir, seed=53, base=perturbed_model(model_dir, seed=51).eval())
    prompt = [1, 2, 3, 4, 5]
    held = engine.version + 2
    try:
        engine.load_weights(hf_model.state_dict().items(), version=held - 1)
        engine.load_weights(new.state_dict().items(), version=held)
        with pytest.raises(StalePushError):
            engine.load_weights(other.state_dict().items(), version=held - 1)  # packed, then refused
        with pytest.raises(StalePushError):
            engine.load_weights(other.state_dict().items(), version=held - 1)  # and again: the same spare set
        expect_answers_of(new, engine, prompt)
        engine.load_weights(lora_adapter(adapted), version=held + 1)  # merged into the base: `new`
        expect_answers_of(merged_copy(adapted), engine, prompt)
    finally:
        engine.load_weights(hf_model.state_dict().items(), version=engine.version + 1)
    expect_answers_of(hf_model, engine, prompt)


def test_a_senders_buckets_reach_the_worker_without_being_packed_again(engine, greedy_policy, model_dir, hf_model) -> None:
    """Buckets (what a Ray push's object holds) go from the collector through the engine to its
    in-process worker as they are: no pack on the way, and the worker's base is the sender's bytes.
    Buckets that do not fit are refused by the engine with nothing changed."""
    from lmcollect.weights.buckets import WeightBuckets, pack_buckets, packs_made

    new = perturbed_model(model_dir, seed=61).eval()
    buckets = pack_buckets(new.state_dict()).to_numpy()  # numpy buffers, as Ray maps them
    prompt = [1, 2, 3, 4, 5]
    collector = lora_collector("continuous", greedy_policy, engine)
    try:
        packs = packs_made()
        collector.receive_weights(buckets)
        assert packs_made() == packs, "the push was packed again on the receiving side"
        sent = sorted(buffer.ctypes.data for buffer in buckets.buffers if buffer.size)
        assert engine.collective_rpc_each("base_buffer_addresses", [()]) == [sent]
        expect_answers_of(new, engine, prompt)
        held = engine.version
        short = WeightBuckets(buckets.layout, [buffer[:-64] for buffer in buckets.buffers])
        with pytest.raises(ValueError, match="buffer 0 is not"):
            engine.load_weights(short, version=held + 1)
        assert engine.version == held
        expect_answers_of(new, engine, prompt)
    finally:
        collector.shutdown()
        engine.load_weights(hf_model.state_dict().items(), version=engine.version + 1)
    expect_answers_of(hf_model, engine, prompt)


def lora_collector(kind: str, greedy_policy: Any, engine: VLLMEngine, **options: Any) -> Any:
    """A lockstep collector over the session's VLLMPolicy, or a continuous one over its engine."""
    if kind == "lockstep":
        return LLMCollector(guessing_env(), policy=greedy_policy, dialog_turns_per_batch=2, **options)
    return ContinuousLLMCollector(
        [guessing_env()], engine=engine, tokenizer=greedy_policy.tokenizer, sampling=greedy_policy.sampling,
        dialog_turns_per_batch=2, **options,
    )


@pytest.mark.parametrize("kind", ["lockstep", "continuous"])
def test_lora_base_rule_and_rank_patterns_in_the_workers(kind, greedy_policy, engine, model_dir, hf_model) -> None:
    """The workers follow the one base rule through either collector: push A, then the merged
    weights in full (exactly what is served), then B: B lands on merged A (peft: B trained on A's
    merge_and_unload()). A peft model with rank_pattern / alpha_pattern pushes as its merge."""
    pytest.importorskip("peft")
    from tests.factories import merged_copy, trained_lora

    base = perturbed_model(model_dir, seed=71).eval()
    peft_a = trained_lora(model_dir, seed=72, base=perturbed_model(model_dir, seed=71))
    merged_a = merged_copy(peft_a)
    peft_on_merged = trained_lora(model_dir, seed=73, targets=("q_proj", "o_proj"), base=merged_copy(peft_a))
    patterns = trained_lora(
        model_dir, seed=74, base=perturbed_model(model_dir, seed=71), rank_pattern={"v_proj": 8}, alpha_pattern={"q_proj": 32}
    )
    prompt = [1, 2, 3, 4, 5]
    collector = lora_collector(kind, greedy_policy, engine)
    try:
        collector.update_policy_weights_(base)
        collector.update_policy_weights_(peft_a)
        expect_answers_of(merged_a, engine, prompt)
        collector.update_policy_weights_(merged_a)  # the values served: still a new base
        collector.update_policy_weights_(peft_on_merged)
        expect_answers_of(merged_copy(peft_on_merged), engine, prompt)
        collector.update_policy_weights_(base)
        collector.update_policy_weights_(patterns)
        expect_answers_of(merged_copy(patterns), engine, prompt)
    finally:
        collector.shutdown()
        engine.load_weights(hf_model.state_dict().items(), version=engine.version + 1)


@pytest.mark.parametrize("kind", ["lockstep", "continuous"])
def test_lora_checkpoint_restores_the_workers_base_and_adapter(kind, greedy_policy, engine, model_dir, hf_model) -> None:
    """A collector's state holds the workers' base (the pushed one, not the merge) and the adapter
    held. The session's one engine stands in for a new process's: between the save and the restore
    it gets other weights (the checkpoint files and another adapter). Restored into a fresh collector,
    it serves base + A, and B then replaces A: base + B, never base + A + B. (Versions untracked: the
    shared engine's version only goes up, and a checkpoint's is older than what it holds by then.)"""
    pytest.importorskip("peft")
    from lmcollect.weights.lora import lora_adapter
    from tests.factories import merged_copy, trained_lora

    base = perturbed_model(model_dir, seed=61).eval()
    peft_a = trained_lora(model_dir, seed=62, base=perturbed_model(model_dir, seed=61))
    peft_b = trained_lora(model_dir, seed=63, targets=("q_proj", "o_proj"), base=perturbed_model(model_dir, seed=61))
    other = trained_lora(model_dir, seed=64, base=load_model_and_tokenizer(model_dir)[0])
    prompt = [1, 2, 3, 4, 5]
    first = lora_collector(kind, greedy_policy, engine, track_policy_version=False)
    fresh = lora_collector(kind, greedy_policy, engine, track_policy_version=False)
    try:
        first.update_policy_weights_(base)
        first.update_policy_weights_(peft_a)
        with first.pause():
            state = first.state_dict()
        saved = state["policy_state_dict"]
        assert all(torch.equal(saved[name], tensor) for name, tensor in base.state_dict().items() if name in saved)
        assert state["lora_adapter"]["scalings"].keys() == lora_adapter(peft_a).layers.keys()
        engine.load_weights(hf_model.state_dict().items(), version=engine.version + 1)
        engine.load_weights(lora_adapter(other), version=engine.version + 1)
        fresh.load_state_dict(state)
        expect_answers_of(merged_copy(peft_a), engine, prompt)
        fresh.update_policy_weights_(peft_b)
        expect_answers_of(merged_copy(peft_b), engine, prompt)
    finally:
        first.shutdown()
        fresh.shutdown()
        engine.load_weights(hf_model.state_dict().items(), version=engine.version + 1)


def test_an_adapter_whose_merge_overflows_is_refused_by_the_workers(engine, hf_model) -> None:
    """Finite factors or scaling whose merge is not: each worker checks the merge before its reload
    (security issue, item 6; the collectors' side is tests/security/test_lora_overflow.py)."""
    from tests.security.test_lora_overflow import huge_factors, huge_scaling

    prompt = [1, 2, 3, 4, 5]
    held = engine.version
    for overflowing in (huge_factors, huge_scaling):
        with pytest.raises(ValueError, match="not finite in their dtype"):
            engine.load_weights(overflowing(hf_model), version=held + 1)
        assert engine.version == held
    expect_answers_of(hf_model, engine, prompt)


def test_a_delta_loads_in_the_workers_and_a_refused_one_changes_nothing(engine, model_dir, hf_model) -> None:
    """A WeightDelta (what RayRemoteWeightUpdater with PushConfig(delta=True) sends a continuous collector) is staged
    in every worker, then reloaded: answers equal the trainer's. A corrupted delta (checksum) or one
    for another base version is refused with the engine's weights and version unchanged."""
    from lmcollect.weights.delta import DeltaBase, DeltaConfig, DeltaRejectedError
    from lmcollect.weights.version import PushVersion

    trainer = sparsely_trained(model_dir, seed=31)
    prompt = [1, 2, 3, 4, 5]
    base = DeltaBase(DeltaConfig())
    held = PushVersion(engine.version + 1)
    try:
        engine.load_weights(hf_model.state_dict().items(), version=held.index)  # the delta's base, in full
        base.snapshot(hf_model.state_dict(), held)
        encoded = base.encode(trainer.state_dict())
        assert encoded is not None, "a change of one layer should go as a delta"
        delta = encoded.delta
        with pytest.raises(DeltaRejectedError, match="checksum"):
            engine.load_weights(corrupted_delta(delta), version=held.index + 1)
        with pytest.raises(DeltaRejectedError, match=f"holds version {held.index}"):
            engine.load_weights(dataclasses.replace(delta, base_version=PushVersion(held.index + 5)), version=held.index + 1)
        assert engine.version == held.index
        expect_answers_of(hf_model, engine, prompt)
        reports = engine.load_weights(delta, version=held.index + 1)
        assert reports and all(report["reload_s"] >= 0 for report in reports)
        expect_answers_of(trainer, engine, prompt)
    finally:
        engine.load_weights(hf_model.state_dict().items(), version=engine.version + 1)
    expect_answers_of(hf_model, engine, prompt)


def expect_answers_of(model: torch.nn.Module, engine: VLLMEngine, prompt: list[int]) -> None:
    result = answer(engine, prompt, greedy(8, ignore_eos=True))
    assert int(result.token_versions[0]) == engine.version
    assert result.tokens.tolist() == generate_greedy(model, prompt, 8, min_new_tokens=8)
    torch.testing.assert_close(result.log_probs, forward_log_probs(model, prompt, result.tokens), atol=ATOL, rtol=0)


# ---------------------------------------------------------------------- the engine contract (tests/engine_contract.py)
@pytest.fixture(scope="module")
def contract_case(greedy_policy: Any, model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> EngineCase:
    engine = greedy_policy.engine
    old = load_model_and_tokenizer(model_dir)[0].eval()
    new = perturbed_model(model_dir, seed=1).eval()
    folder = tmp_path_factory.mktemp("held-steps")
    eos_ids = checkpoint_eos_token_ids(model_dir, greedy_policy.tokenizer)
    return hf_case(
        engine, old, new, hold_step=lambda step: held_step(engine, step, folder), eos_token_ids=eos_ids, log_prob_atol=ATOL,
        caches_prefixes=True,
    )


@pytest.mark.parametrize("check", [name for name in CHECKS if name != "close"])
def test_engine_contract(contract_case: EngineCase, check: str) -> None:
    CHECKS[check](contract_case)


def test_close_fails_pending_futures(contract_case: EngineCase) -> None:
    """Last: closes the session's in-process engine."""
    CHECKS["close"](contract_case)  # pending futures fail with EngineClosedError, new requests are refused
    engine = contract_case.engine
    assert engine.num_in_flight == 0
    with pytest.raises(Exception, match="closed"):
        engine.resume()
    engine.close()  # idempotent
