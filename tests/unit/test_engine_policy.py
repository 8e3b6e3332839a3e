"""EnginePolicy: the lockstep LLMCollector over an engine (the continuous path with a batch barrier)."""
from __future__ import annotations

import pytest
import torch

from lmcollect.collectors import ContinuousLLMCollector, LLMCollector
from lmcollect.data import keys
from lmcollect.data.turns import flatten_turns, non_tensor_values
from lmcollect.engines import TransformersEngine
from lmcollect.policies import EnginePolicy
from lmcollect.envs import ChatEnv, GuessingGameTask, guessing_game_dataset
from lmcollect.policies import SamplingConfig, TransformersPolicy
from lmcollect.weights.tensors import to_weight_dict
from tests.factories import perturbed_model

GREEDY = SamplingConfig(temperature=0, max_new_tokens=12)
NUM_ENVS = 3


@pytest.fixture(scope="module")
def tokenizer(tiny_model_and_tokenizer):
    return tiny_model_and_tokenizer[1]


@pytest.fixture
def engine(tiny_model_path, tokenizer):
    engine = TransformersEngine(perturbed_model(tiny_model_path, seed=1), tokenizer)
    yield engine
    engine.close()


def guessing_env(seed: int, batch_size: int = 1) -> ChatEnv:
    return ChatEnv(guessing_game_dataset(16, seed=0), task=GuessingGameTask(), batch_size=batch_size, max_turns=5, seed=seed)


def first_batch(collector) -> list:
    with collector:
        return flatten_turns(collector.next())


def assert_same_turns(got: list, expected: list) -> None:
    assert len(got) == len(expected)
    for mine, theirs in zip(got, expected):
        for key in (keys.TOKENS_PROMPT, keys.TOKENS_RESPONSE, keys.TOKENS_FULL, keys.TOKEN_VERSIONS):
            assert torch.equal(mine.get(key), theirs.get(key)), key
        torch.testing.assert_close(mine.get(keys.LOG_PROBS_RESPONSE), theirs.get(keys.LOG_PROBS_RESPONSE), atol=1e-4, rtol=0)
        assert non_tensor_values(mine, keys.HISTORY_FULL) == non_tensor_values(theirs, keys.HISTORY_FULL)


def test_lockstep_over_an_engine_equals_the_transformers_policy(engine, tiny_model_path, tokenizer) -> None:
    """Same prompts, tokens and log-probs as today's lockstep policy: the engine is the only difference."""
    policy = TransformersPolicy(perturbed_model(tiny_model_path, seed=1), tokenizer, sampling=GREEDY)
    expected = first_batch(LLMCollector(guessing_env(0, NUM_ENVS), policy=policy, dialog_turns_per_batch=9, flatten_data=True))
    on_engine = EnginePolicy(engine, tokenizer=tokenizer, sampling=GREEDY, stop_token_ids=policy.stop_token_ids)
    got = first_batch(LLMCollector(guessing_env(0, NUM_ENVS), policy=on_engine, dialog_turns_per_batch=9, flatten_data=True))
    assert max(int(t[keys.STEP_COUNT]) for t in got) >= 1  # multi-turn: later prompts extend earlier tokens
    assert_same_turns(got, expected)


def test_the_barrier_is_the_only_difference_from_continuous_mode(engine, tokenizer) -> None:
    """One dialog: lockstep and continuous collection over one engine give the same turns."""
    lockstep = LLMCollector(
        guessing_env(0), policy=EnginePolicy(engine, tokenizer=tokenizer, sampling=GREEDY), dialog_turns_per_batch=3,
        flatten_data=True,
    )
    continuous = ContinuousLLMCollector(
        [guessing_env(0)], engine=engine, tokenizer=tokenizer, sampling=GREEDY, dialog_turns_per_batch=3
    )
    assert_same_turns(first_batch(continuous), first_batch(lockstep))


def test_a_push_goes_through_the_engine_and_labels_its_version(engine, tiny_model_path, tokenizer) -> None:
    policy = EnginePolicy(engine, tokenizer=tokenizer, sampling=GREEDY)
    collector = LLMCollector(guessing_env(0), policy=policy, dialog_turns_per_batch=2, track_policy_version=True)
    new = perturbed_model(tiny_model_path, seed=2)
    with collector:
        collector.next()
        collector.update_policy_weights_(new)
        assert engine.version == collector.version_index() == 1
        for name, tensor in to_weight_dict(new).items():
            assert torch.equal(engine.model.state_dict()[name], tensor), name
        batch = flatten_turns(collector.next())
        bad = {name: t.clone() for name, t in to_weight_dict(new).items()}
        dropped = sorted(bad)[len(bad) // 2]
        del bad[dropped]
        before = {name: t.clone() for name, t in engine.model.state_dict().items()}
        with pytest.raises(ValueError, match=dropped):
            collector.receive_weights(bad)
    assert all(int(turn.get(keys.POLICY_VERSION)) == 1 for turn in batch)
    assert all(set(turn.get(keys.TOKEN_VERSIONS).tolist()) == {1} for turn in batch)  # the engine's record, kept
    assert engine.version == 1 and all(torch.equal(engine.model.state_dict()[k], v) for k, v in before.items())


def test_the_lockstep_and_continuous_turns_carry_the_same_token_versions_when_tracked(engine, tokenizer) -> None:
    lockstep = LLMCollector(
        guessing_env(0), policy=EnginePolicy(engine, tokenizer=tokenizer, sampling=GREEDY), dialog_turns_per_batch=3,
        flatten_data=True, track_policy_version=True,
    )
    continuous = ContinuousLLMCollector(
        [guessing_env(0)], engine=engine, tokenizer=tokenizer, sampling=GREEDY, dialog_turns_per_batch=3,
        track_policy_version=True,
    )
    got, want = first_batch(lockstep), first_batch(continuous)
    assert_same_turns(got, want)
    assert all(set(t.get(keys.TOKEN_VERSIONS).tolist()) == {0} for t in got)  # the initial weights: version 0


def test_state_dict_over_an_engine_keeps_the_weights_and_the_seed_stream(tiny_model_path, tokenizer) -> None:
    """A collector restored into a fresh engine (other weights, other seed) yields what the saved one would have."""
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=8)

    def collector_over(seed: int) -> LLMCollector:
        engine = TransformersEngine(perturbed_model(tiny_model_path, seed=seed), tokenizer)
        policy = EnginePolicy(engine, tokenizer=tokenizer, sampling=sampling, seed=seed)
        return LLMCollector(guessing_env(0, 2), policy=policy, dialog_turns_per_batch=2, track_policy_version=True)

    saved = collector_over(1)
    saved.update_policy_weights_(perturbed_model(tiny_model_path, seed=3))
    flatten_turns(saved.next())
    state = saved.state_dict()
    assert state["policy_state_dict"] is not None and state["rng"]["policy"] is not None
    expected = flatten_turns(saved.next())
    fresh = collector_over(2)
    fresh.load_state_dict(state)
    assert fresh.policy.engine.version == fresh.version_index() == 1
    got = flatten_turns(fresh.next())
    assert_same_turns(got, expected)
    for collector in (saved, fresh):
        collector.shutdown()
        collector.policy.engine.close()


def test_convert_dtype_casts_a_push_to_the_engines_dtype(engine, tiny_model_path, tokenizer) -> None:
    collector = LLMCollector(guessing_env(0), policy=EnginePolicy(engine, tokenizer=tokenizer, sampling=GREEDY),
                             dialog_turns_per_batch=2, track_policy_version=True)
    bf16 = {name: t.to(torch.bfloat16) for name, t in to_weight_dict(perturbed_model(tiny_model_path, seed=2)).items()}
    before = {name: t.clone() for name, t in engine.model.state_dict().items()}
    with pytest.raises(ValueError, match="pass convert_dtype=True"):
        collector.receive_weights(bf16)
    assert all(torch.equal(engine.model.state_dict()[k], v) for k, v in before.items())
    collector.receive_weights(bf16, convert_dtype=True)
    for name, tensor in bf16.items():
        held = engine.model.state_dict()[name]
        assert held.dtype == torch.float32 and torch.equal(held, tensor.float()), name
    assert engine.version == collector.version_index() == 1
    collector.shutdown()


def test_seeded_sampling_repeats(engine, tokenizer) -> None:
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=8)
    runs = []
    for _ in range(2):
        policy = EnginePolicy(engine, tokenizer=tokenizer, sampling=sampling, seed=7)
        runs.append(first_batch(LLMCollector(guessing_env(0, 2), policy=policy, dialog_turns_per_batch=2, flatten_data=True)))
    assert all(torch.equal(a.get(keys.TOKENS_RESPONSE), b.get(keys.TOKENS_RESPONSE)) for a, b in zip(*runs))


def test_engine_must_implement_the_protocol(tokenizer) -> None:
    with pytest.raises(TypeError, match="EngineProtocol"):
        EnginePolicy(object(), tokenizer=tokenizer)


def test_a_collector_over_an_engine_holding_a_push_counts_on_and_an_older_push_is_refused(engine, tiny_model_path, tokenizer) -> None:
    """Both schedulers start from the version the engine holds; the engine itself refuses a push
    older than that (where the load would take effect), whoever sends it."""
    from lmcollect.engines import StalePushError

    pushed = to_weight_dict(perturbed_model(tiny_model_path, seed=2))
    engine.load_weights(pushed.items(), version=5)  # an earlier collector's push
    lockstep = LLMCollector(guessing_env(0), policy=EnginePolicy(engine, tokenizer=tokenizer, sampling=GREEDY),
                            dialog_turns_per_batch=2, track_policy_version=True)
    continuous = ContinuousLLMCollector([guessing_env(0)], engine=engine, tokenizer=tokenizer, sampling=GREEDY,
                                        dialog_turns_per_batch=2, track_policy_version=True)
    assert lockstep.version_index() == continuous.version_index() == 5
    lockstep.update_policy_weights_(pushed)
    assert lockstep.version_index() == engine.version == 6
    with pytest.raises(StalePushError, match="holds version 6, which is newer"):
        engine.load_weights(pushed.items(), version=4)
    assert engine.version == 6
    turns = first_batch(lockstep)
    assert {int(t[keys.POLICY_VERSION]) for t in turns} == {6}
    assert all(set(t.get(keys.TOKEN_VERSIONS).tolist()) == {6} for t in turns)
    continuous.shutdown()
