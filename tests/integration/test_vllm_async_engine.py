"""VLLMAsyncEngine (vLLM's AsyncLLM in-process) on the tiny model; skipped where vLLM is not installed.

Run it with a Python that has vLLM: ``python -m pytest tests/integration/test_vllm_async_engine.py``.
One engine serves the module (its core is a subprocess, ~20 s to start); the weight test puts the
original weights back, and the close test, last in the file, closes it.
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from tensordict import TensorDictBase

from lmcollect.collectors import ContinuousLLMCollector, LLMCollector
from lmcollect.data import keys
from lmcollect.data.turns import flatten_turns, non_tensor_values
from lmcollect.envs import ChatEnv, GuessingGameTask, SingleTurnTask, arithmetic_dataset, guessing_game_dataset
from lmcollect.engines import EngineClosedError, EngineProtocol, EngineRequest, EngineResult
from lmcollect.models import load_model_and_tokenizer
from lmcollect.engines.sampling import SamplingConfig
from lmcollect.weight_sync import vLLMUpdater
from tests.engine_contract import CHECKS, EngineCase, hf_reference, prompts_of_lengths
from tests.factories import perturbed_model, run_in_thread
from tests.processes import is_alive, live_descendants
from tests.integration.conftest import CPU_ENGINE_KWARGS, MAX_NEW_TOKENS, QUESTIONS, chat_batch
from tests.vllm_hold import HOLDING_EXTENSION, held_step

pytest.importorskip("vllm")
from lmcollect.engines.vllm_async import VLLMAsyncEngine  # noqa: E402

pytestmark = pytest.mark.integration

ATOL = 1e-4
RESULT_TIMEOUT_S = 120.0
LONG_RESPONSE_TOKENS = 300  # long enough to be mid-generation when the pause comes


@dataclass
class Started:
    engine: VLLMAsyncEngine
    child_pids: set[int]
    """Processes the engine started (its engine core and workers): gone after close()."""


def child_pids() -> set[int]:
    """This process's live descendants, but Python's multiprocessing resource tracker (it lives as long as we do)."""
    return live_descendants(exclude_cmdline=("resource_tracker",))


@pytest.fixture(scope="module")
def started(model_dir: Path) -> Iterator[Started]:
    before = child_pids()
    # our worker extension plus the contract's hold hook (tests/vllm_hold.py)
    engine_kwargs = {**CPU_ENGINE_KWARGS, "worker_extension_cls": HOLDING_EXTENSION}
    engine = VLLMAsyncEngine(model_dir, engine_kwargs=engine_kwargs, timeout_s=120.0)
    yield Started(engine, child_pids() - before)
    engine.close()


@pytest.fixture
def async_engine(started: Started) -> VLLMAsyncEngine:
    return started.engine


@pytest.fixture(scope="module")
def hf_model(model_dir: Path) -> torch.nn.Module:
    return load_model_and_tokenizer(model_dir)[0].eval()


@pytest.fixture(scope="module")
def sync_answers(started: Started, request: pytest.FixtureRequest) -> TensorDictBase:
    """The synchronous ``vllm.LLM`` policy's greedy answers to QUESTIONS (QUESTIONS[0] stops at an eos).

    Asked for after the async engine is up, so its engine core is not forked from a process that
    already runs an in-process engine.
    """
    return request.getfixturevalue("greedy_policy")(chat_batch(QUESTIONS))


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


def answer(engine: VLLMAsyncEngine, prompt_ids: list[int], sampling: SamplingConfig, **fields: Any) -> EngineResult:
    return engine.submit(EngineRequest(prompt_ids=prompt_ids, sampling=sampling, **fields)).result(RESULT_TIMEOUT_S)


# ------------------------------------------------------------------------------------ generation
def test_concurrent_submits_equal_the_synchronous_engine(
    async_engine: VLLMAsyncEngine, sync_answers: TensorDictBase
) -> None:
    assert isinstance(async_engine, EngineProtocol)
    futures = [
        async_engine.submit(EngineRequest(prompt_ids=prompt_of(sync_answers, i), sampling=greedy(), request_id=f"q{i}"))
        for i in range(len(QUESTIONS))
    ]
    results = [f.result(RESULT_TIMEOUT_S) for f in futures]
    for i, result in enumerate(results):
        assert torch.equal(result.tokens, sync_answers[i][keys.TOKENS_RESPONSE]), f"question {i}"
        torch.testing.assert_close(result.log_probs, sync_answers[i][keys.LOG_PROBS_RESPONSE], atol=ATOL, rtol=0)
        assert result.tokens.dtype == torch.long and result.log_probs.dtype == torch.float32
        assert torch.equal(result.token_versions, torch.full_like(result.tokens, -1))
    assert results[0].finish_reason == "stop" and len(results[0].tokens) < MAX_NEW_TOKENS  # the extra eos, kept
    assert all(r.finish_reason == "length" and len(r.tokens) == MAX_NEW_TOKENS for r in results[1:])
    assert async_engine.num_in_flight == 0 and async_engine.version == -1


def test_log_probs_equal_a_transformers_forward_pass(
    async_engine: VLLMAsyncEngine, sync_answers: TensorDictBase, hf_model: torch.nn.Module
) -> None:
    sampled = SamplingConfig(temperature=1.0, max_new_tokens=MAX_NEW_TOKENS)
    for i in range(len(QUESTIONS)):
        prompt = prompt_of(sync_answers, i)
        for result in (answer(async_engine, prompt, greedy()), answer(async_engine, prompt, sampled, seed=i)):
            want = forward_log_probs(hf_model, prompt, result.tokens)
            torch.testing.assert_close(result.log_probs, want, atol=ATOL, rtol=0)


def test_seeds_and_stop_token_ids(async_engine: VLLMAsyncEngine, sync_answers: TensorDictBase) -> None:
    prompt = prompt_of(sync_answers, 1)
    sampled = SamplingConfig(temperature=1.0, max_new_tokens=16)
    first, again = (answer(async_engine, prompt, sampled, seed=7) for _ in range(2))
    assert torch.equal(first.tokens, again.tokens)
    others = [answer(async_engine, prompt, sampled, seed=s).tokens for s in (8, 9, 10)]
    assert any(not torch.equal(first.tokens, o) for o in others), "the seed does not reach the sampler"

    full = answer(async_engine, prompt, greedy(ignore_eos=True))
    stop_id = int(full.tokens[5])
    end = full.tokens.tolist().index(stop_id) + 1
    stopped = answer(async_engine, prompt, greedy(ignore_eos=True), stop_token_ids=(stop_id,))
    assert stopped.finish_reason == "stop" and torch.equal(stopped.tokens, full.tokens[:end])  # stop token kept

    with pytest.raises(ValueError, match="stop_strings"):
        async_engine.submit(EngineRequest(prompt_ids=prompt, sampling=greedy(stop_strings=("x",))))
    with pytest.raises(ValueError, match="sampled_log_probs"):
        async_engine.submit(EngineRequest(prompt_ids=prompt, sampling=greedy(sampled_log_probs=True)))
    with pytest.raises(ValueError, match="prompt_ids"):
        async_engine.submit(EngineRequest(prompt_ids=[], sampling=greedy()))


# ------------------------------------------------------------------------------------ weights
def test_load_during_a_pause_switches_in_flight_tokens_to_the_new_weights(
    async_engine: VLLMAsyncEngine, sync_answers: TensorDictBase, hf_model: torch.nn.Module, model_dir: Path
) -> None:
    new_model = perturbed_model(model_dir, seed=1).eval()
    prompt = prompt_of(sync_answers, 1)
    long = async_engine.submit(
        EngineRequest(prompt_ids=prompt, sampling=greedy(LONG_RESPONSE_TOKENS, ignore_eos=True), request_id="long")
    )
    # a later request of 8 tokens finishing means the long one has at least 8 tokens too
    answer(async_engine, prompt_of(sync_answers, 2), greedy(8, ignore_eos=True))
    try:
        async_engine.pause()
        assert not long.done() and async_engine.num_in_flight == 1 and async_engine.paused
        async_engine.load_weights(new_model.state_dict().items(), version=7)
        assert async_engine.version == 7 and not long.done()
        async_engine.reset_prefix_cache()
        async_engine.resume()
        result = long.result(RESULT_TIMEOUT_S)
    finally:
        async_engine.load_weights(hf_model.state_dict().items(), version=8)  # the next tests' weights
        if async_engine.paused:
            async_engine.resume()

    assert len(result.tokens) == LONG_RESPONSE_TOKENS  # the pause lost no token
    switch = int((result.token_versions == -1).sum())
    assert 8 <= switch < LONG_RESPONSE_TOKENS
    assert torch.equal(result.token_versions[:switch], torch.full((switch,), -1))
    assert torch.equal(result.token_versions[switch:], torch.full((LONG_RESPONSE_TOKENS - switch,), 7))
    # each segment's log-probs are those of a forward pass under the weights its version names
    old_segment = forward_log_probs(hf_model, prompt, result.tokens)[:switch]
    new_logits = forward_logits(new_model, prompt, result.tokens)[switch:]
    new_segment = torch.log_softmax(new_logits, dim=-1).gather(1, result.tokens[switch:, None])[:, 0]
    torch.testing.assert_close(result.log_probs[:switch], old_segment, atol=ATOL, rtol=0)
    torch.testing.assert_close(result.log_probs[switch:], new_segment, atol=ATOL, rtol=0)
    assert torch.equal(result.tokens[switch:], new_logits.argmax(dim=-1))  # greedy under the new weights
    not_old = forward_log_probs(hf_model, prompt, result.tokens)[switch:]
    assert (result.log_probs[switch:] - not_old).abs().max() > 1e-2  # the check can tell the weights apart


def test_bad_loads_are_refused_and_change_nothing(
    async_engine: VLLMAsyncEngine, sync_answers: TensorDictBase, hf_model: torch.nn.Module
) -> None:
    prompt = prompt_of(sync_answers, 2)
    before = answer(async_engine, prompt, greedy())
    version = async_engine.version
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
            async_engine.load_weights(weights.items(), version=version + 1)
    with pytest.raises(TypeError, match="version"):
        async_engine.load_weights(state.items(), version="1")  # type: ignore[arg-type]
    assert async_engine.version == version and not async_engine.paused
    after = answer(async_engine, prompt, greedy())
    assert torch.equal(after.tokens, before.tokens) and torch.equal(after.log_probs, before.log_probs)

    # a load while running pauses around itself; the same weights answer the same
    async_engine.load_weights(state.items(), version=version + 1)
    assert async_engine.version == version + 1 and not async_engine.paused
    again = answer(async_engine, prompt, greedy())
    assert torch.equal(again.tokens, before.tokens)
    assert torch.equal(again.token_versions, torch.full_like(again.tokens, version + 1))


# ------------------------------------------------------------------------------------ close (last: ends the engine)
# ---------------------------------------------------------------------- continuous collection over it
def guessing_env(seed: int = 0) -> ChatEnv:
    return ChatEnv(guessing_game_dataset(16, seed=0), task=GuessingGameTask(), batch_size=1, max_turns=4, seed=seed)


def test_greedy_turns_equal_the_synchronous_collectors(async_engine, greedy_policy) -> None:
    sync = LLMCollector(guessing_env(), policy=greedy_policy, dialog_turns_per_batch=6, flatten_data=True)
    cont = ContinuousLLMCollector(
        [guessing_env()], engine=async_engine, tokenizer=greedy_policy.tokenizer,
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
def test_a_push_mid_turn_is_recorded_per_token(async_engine, model_dir, greedy_policy, push) -> None:
    """Either updater lands mid-turn: receive_weights (load_weights), or vLLMUpdater broadcasting
    straight into the engine's workers through the WorkerRpcEngine interface while it is paused."""
    old, _ = load_model_and_tokenizer(model_dir)
    new = perturbed_model(model_dir, seed=5)
    env = ChatEnv(arithmetic_dataset(8, seed=0), task=SingleTurnTask(), batch_size=1, seed=0)
    updater = vLLMUpdater(timeout_s=60) if push == "process group" else None
    collector = ContinuousLLMCollector(
        [env], engine=async_engine, tokenizer=greedy_policy.tokenizer, dialog_turns_per_batch=1, track_policy_version=True,
        sampling=SamplingConfig(max_new_tokens=300, temperature=0, ignore_eos=True), weight_updater=updater,
    )
    try:
        join = run_in_thread(collector.next, timeout_s=180)
        deadline = time.monotonic() + 60
        while async_engine.num_in_flight == 0:
            assert time.monotonic() < deadline, "the turn never started"
            time.sleep(0.01)
        time.sleep(0.2)
        collector.update_policy_weights_(new)  # lands while the 300-token turn runs
        turn = flatten_turns(join())[0]
        assert async_engine.version == collector.version_index()
    finally:
        collector.shutdown()
        if updater is not None:
            updater.close()
        async_engine.load_weights(old.state_dict().items(), version=async_engine.version + 1)  # as before
    versions = turn.get(keys.TOKEN_VERSIONS)
    assert versions[0] < versions[-1] and set(versions.tolist()) == {int(versions[0]), int(versions[-1])}
    full, num_prompt = turn.get(keys.TOKENS_FULL), turn.get(keys.TOKENS_PROMPT).numel()
    stored = turn.get(keys.LOG_PROBS_RESPONSE)
    for model, version in ((old, int(versions[0])), (new, int(versions[-1]))):
        segment = versions == version
        torch.testing.assert_close(stored[segment], _forward_log_probs(model, full, num_prompt)[segment], atol=1e-4, rtol=0)


def test_a_bare_engine_takes_process_group_pushes(async_engine, model_dir, hf_model) -> None:
    """vLLMUpdater.from_policy(engine): no collector; the push pauses the engine, labels the version."""
    new = perturbed_model(model_dir, seed=6)
    updater = vLLMUpdater.from_policy(async_engine)
    assert updater is not None
    prompt = [1, 2, 3, 4]
    try:
        updater.push_weights(new)
        result = answer(async_engine, prompt, greedy(8))
        assert int(result.token_versions[0]) == async_engine.version == updater.version
        torch.testing.assert_close(
            result.log_probs, forward_log_probs(new, prompt, result.tokens), atol=ATOL, rtol=0
        )
    finally:
        updater.close()
        async_engine.load_weights(hf_model.state_dict().items(), version=async_engine.version + 1)


# ---------------------------------------------------------------------- the engine contract (tests/engine_contract.py)
def eos_free(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` generating to its length limit: model_dir's extra eos would end a reference early
    (the contract's requests ignore eos)."""
    model.generation_config.eos_token_id = None
    return model


@pytest.fixture(scope="module")
def contract_case(started: Started, model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> EngineCase:
    old = eos_free(load_model_and_tokenizer(model_dir)[0].eval())
    new = eos_free(perturbed_model(model_dir, seed=1).eval())
    bad = dict(new.state_dict())
    bad["model.norm.weight"] = torch.zeros(3)
    folder = tmp_path_factory.mktemp("held-steps")
    return EngineCase(
        engine=started.engine,
        prompts=prompts_of_lengths((3, 9, 5)),
        old=hf_reference(old),
        new=hf_reference(new),
        new_weights=dict(new.state_dict()),
        old_weights=dict(old.state_dict()),
        bad_weights=bad,
        hold_step=lambda step: held_step(started.engine, step, folder),
        log_prob_atol=ATOL,
    )


@pytest.mark.parametrize("check", [name for name in CHECKS if name != "close"])
def test_engine_contract(contract_case: EngineCase, check: str) -> None:
    CHECKS[check](contract_case)


def test_close_fails_pending_futures_and_stops_the_engine_processes(started: Started, contract_case: EngineCase) -> None:
    engine = started.engine
    # on CPU the one worker runs inside the engine core's process: one Python, not two (_engine_config)
    assert len(started.child_pids) == 1, f"want only the engine core's process, got {started.child_pids}"
    CHECKS["close"](contract_case)  # pending futures fail with EngineClosedError, new requests are refused
    assert engine.num_in_flight == 0
    with pytest.raises(EngineClosedError):
        engine.resume()
    engine.close()  # idempotent
    deadline = time.monotonic() + 30
    while any(is_alive(pid) for pid in started.child_pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(is_alive(pid) for pid in started.child_pids), "an engine process outlived close()"

