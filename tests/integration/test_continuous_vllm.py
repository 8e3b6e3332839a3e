"""ContinuousLLMCollector over VLLMAsyncEngine (vLLM's AsyncLLM): the same turns as the synchronous
collector with VLLMPolicy, and a push mid-turn recorded token by token. Skipped without vLLM."""
from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from lmcollect.collectors import ContinuousLLMCollector, LLMCollector
from lmcollect.data import keys
from lmcollect.data.turns import flatten_turns, non_tensor_values
from lmcollect.envs import ChatEnv, GuessingGameTask, SingleTurnTask, arithmetic_dataset, guessing_game_dataset
from lmcollect.models import load_model_and_tokenizer
from lmcollect.policies.sampling import SamplingConfig
from tests.factories import perturbed_model, run_in_thread
from tests.integration.conftest import CPU_ENGINE_KWARGS

pytest.importorskip("vllm")
from lmcollect.engines.vllm_async import VLLMAsyncEngine  # noqa: E402

pytestmark = pytest.mark.integration


def guessing_env(seed: int = 0) -> ChatEnv:
    return ChatEnv(guessing_game_dataset(16, seed=0), task=GuessingGameTask(), batch_size=1, max_turns=4, seed=seed)


@pytest.fixture(scope="module")
def async_engine(model_dir: Path):
    engine = VLLMAsyncEngine(model_dir, engine_kwargs=CPU_ENGINE_KWARGS, timeout_s=120.0)
    yield engine
    engine.close()


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


def test_a_push_mid_turn_is_recorded_per_token(async_engine, model_dir, greedy_policy) -> None:
    old, _ = load_model_and_tokenizer(model_dir)
    new = perturbed_model(model_dir, seed=5)
    env = ChatEnv(arithmetic_dataset(8, seed=0), task=SingleTurnTask(), batch_size=1, seed=0)
    collector = ContinuousLLMCollector(
        [env], engine=async_engine, tokenizer=greedy_policy.tokenizer, dialog_turns_per_batch=1, track_policy_version=True,
        sampling=SamplingConfig(max_new_tokens=300, temperature=0, ignore_eos=True),
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
    finally:
        collector.shutdown()
        async_engine.load_weights(old.state_dict().items(), version=async_engine.version + 1)  # as before
    versions = turn.get(keys.TOKEN_VERSIONS)
    assert versions[0] < versions[-1] and set(versions.tolist()) == {int(versions[0]), int(versions[-1])}
    full, num_prompt = turn.get(keys.TOKENS_FULL), turn.get(keys.TOKENS_PROMPT).numel()
    stored = turn.get(keys.LOG_PROBS_RESPONSE)
    for model, version in ((old, int(versions[0])), (new, int(versions[-1]))):
        segment = versions == version
        torch.testing.assert_close(stored[segment], _forward_log_probs(model, full, num_prompt)[segment], atol=1e-4, rtol=0)
