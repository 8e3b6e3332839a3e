"""LoRA pushes: an adapter of a trained peft model, merged by the engine into its kept base, answers
as the merged model does; adapters replace each other; a bad one changes nothing."""

from __future__ import annotations

import dataclasses
import math
import pickle
import time

import pytest
import torch

from lmcollect.collectors import LLMCollector
from lmcollect.engines import EngineRequest, TransformersEngine
from lmcollect.policies import SamplingConfig, TransformersPolicy
from lmcollect.weight_sync import LocalWeightUpdater
from lmcollect.weights.delta import PushStats
from lmcollect.weights.kept_base import KeptBase
from lmcollect.weights.lora import LoraAdapter, LoraLayerWeights, adapter_problems, lora_adapter
from tests.engine_contract import forward_log_probs, generate_greedy
from tests.factories import merged_copy, perturbed_model, trained_lora

pytest.importorskip("peft", reason="LoRA tests need the lora extra: pip install 'lmcollect[lora]'")

TIMEOUT_S = 60
PROMPTS = ([5, 17, 230, 41], [9, 300, 12, 12, 77, 4, 8])


@pytest.fixture(scope="module")
def tokenizer(tiny_model_and_tokenizer):
    return tiny_model_and_tokenizer[1]


@pytest.fixture(scope="module")
def peft_a(tiny_model_path):
    return trained_lora(tiny_model_path, seed=11)


@pytest.fixture(scope="module")
def peft_b(tiny_model_path):
    """Another adapter, on other layers (o_proj only), so switching must put q/v back."""
    return trained_lora(tiny_model_path, seed=12, targets=("o_proj",))


@pytest.fixture
def engine(tiny_model_path, tokenizer):
    engine = TransformersEngine(perturbed_model(tiny_model_path, seed=1), tokenizer)
    yield engine
    engine.close()


def weights_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


def assert_same_weights(model: torch.nn.Module, reference: torch.nn.Module) -> None:
    expected = reference.state_dict()
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=1e-6, msg=name)


def greedy_answers(engine: TransformersEngine, max_new_tokens: int = 10) -> list[list[int]]:
    sampling = SamplingConfig(temperature=0, max_new_tokens=max_new_tokens, ignore_eos=True)
    futures = [engine.submit(EngineRequest(prompt_ids=list(p), sampling=sampling)) for p in PROMPTS]
    return [future.result(TIMEOUT_S).tokens.tolist() for future in futures]


def test_the_adapter_of_a_peft_model_names_the_base_layers_with_peft_scaling(peft_a):
    adapter = lora_adapter(peft_a)
    assert adapter.rank == 4
    assert sorted(adapter.layers) == sorted(
        f"model.layers.{i}.self_attn.{p}.weight" for i in range(2) for p in ("q_proj", "v_proj")
    ) or all(".self_attn." in name for name in adapter.layers)
    assert {layer.scaling for layer in adapter.layers.values()} == {2.0}  # lora_alpha / r
    assert adapter.nbytes == sum(
        p.numel() * p.element_size() for n, p in peft_a.named_parameters() if "lora_" in n
    )


def test_a_state_dict_with_its_config_gives_the_same_adapter_rslora_included(tiny_model_path):
    from peft import get_peft_model_state_dict

    model = trained_lora(tiny_model_path, seed=13, use_rslora=True, steps=1)
    from_model = lora_adapter(model)
    from_state = lora_adapter(get_peft_model_state_dict(model), model.peft_config["default"])
    assert from_model.layers.keys() == from_state.layers.keys()
    for name, layer in from_model.layers.items():
        assert math.isclose(layer.scaling, 8 / math.sqrt(4)) and math.isclose(from_state.layers[name].scaling, layer.scaling)
        torch.testing.assert_close(from_state.layers[name].delta(), layer.delta())


def test_an_adapter_push_answers_as_the_merged_model(engine, peft_a):
    merged = merged_copy(peft_a)
    engine.load_weights(lora_adapter(peft_a), version=1)
    assert engine.version == 1
    assert_same_weights(engine.model, merged)
    answers = greedy_answers(engine)
    for prompt, tokens in zip(PROMPTS, answers, strict=True):
        assert tokens == generate_greedy(merged, list(prompt), 10, min_new_tokens=10)
    result = engine.submit(
        EngineRequest(prompt_ids=list(PROMPTS[0]), sampling=SamplingConfig(temperature=0, max_new_tokens=6, ignore_eos=True))
    ).result(TIMEOUT_S)
    torch.testing.assert_close(
        result.log_probs, forward_log_probs(merged, list(PROMPTS[0]), result.tokens.tolist()), rtol=0, atol=1e-4
    )


def test_adapters_replace_each_other_and_a_full_push_is_the_new_base(engine, peft_a, peft_b, tiny_model_path):
    engine.load_weights(lora_adapter(peft_a), version=1)
    engine.load_weights(lora_adapter(peft_b), version=2)  # o_proj only: q/v go back to the base
    assert_same_weights(engine.model, merged_copy(peft_b))
    new_base = perturbed_model(tiny_model_path, seed=5)
    engine.load_weights(new_base.state_dict().items(), version=3)
    assert_same_weights(engine.model, new_base)
    engine.load_weights(lora_adapter(peft_a), version=4)
    expected = lora_adapter(peft_a).merged_into(new_base.state_dict())
    for name, tensor in expected.items():
        torch.testing.assert_close(engine.model.state_dict()[name], tensor, rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_adapter_pickles_as_packed_bytes_and_comes_back_equal(peft_a, dtype):
    """What ``ray.put`` does to it: one packed buffer per dtype, not one serialized tensor each."""
    adapter = lora_adapter(peft_a)
    adapter = LoraAdapter(
        layers={n: LoraLayerWeights(w.lora_a.to(dtype), w.lora_b.to(dtype), w.scaling) for n, w in adapter.layers.items()},
        rank=adapter.rank,
    )
    payload = pickle.dumps(adapter, protocol=5)
    assert len(payload) < adapter.nbytes + 64 * 2 * len(adapter.layers) + 16_000
    back = pickle.loads(payload)
    assert back.rank == adapter.rank and back.layers.keys() == adapter.layers.keys()
    for name, layer in adapter.layers.items():
        got = back.layers[name]
        assert got.scaling == layer.scaling and got.lora_a.dtype == dtype
        assert torch.equal(got.lora_a, layer.lora_a) and torch.equal(got.lora_b, layer.lora_b), name


def test_any_write_but_the_merge_is_a_new_base_even_of_the_merged_values(peft_a, peft_b):
    """The base rule: a merge is written in place and adapters replace each other on the kept base;
    a write by another path (a full push) is a new base, even one of exactly the merged values."""
    a, b = lora_adapter(peft_a), lora_adapter(peft_b)
    base = {name: torch.randn(layer.lora_b.shape[0], layer.lora_a.shape[1]) for name, layer in {**a.layers, **b.layers}.items()}
    model = {name: t.clone() for name, t in base.items()}
    kept = KeptBase()
    kept.merge_into(a, model)
    for name, tensor in a.merged_into(base).items():
        assert torch.equal(model[name], tensor), name
    kept.merge_into(b, model)  # q/v back to the base, o_proj adapted
    for name in base:
        expected = b.layers[name].merged(base[name]) if name in b.layers else base[name]
        assert torch.equal(model[name], expected), name
    merged_b = {name: t.clone() for name, t in model.items()}
    for name, tensor in model.items():  # the merged model pushed in full: the same values, a new base
        tensor.copy_(merged_b[name])
    assert kept.held(model) is None
    kept.merge_into(a, model)
    for name in base:
        expected = a.layers[name].merged(merged_b[name]) if name in a.layers else merged_b[name]
        assert torch.equal(model[name], expected), name
    held_base, held_adapter = kept.held(model)
    assert held_adapter.layers.keys() == a.layers.keys()
    for name in a.layers:
        assert torch.equal(held_base[name], merged_b[name]), name


def _reranked(adapter: LoraAdapter) -> LoraAdapter:
    name, layer = next(iter(adapter.layers.items()))
    bigger = LoraLayerWeights(torch.zeros(8, layer.lora_a.shape[1]), torch.zeros(layer.lora_b.shape[0], 8), layer.scaling)
    return dataclasses.replace(adapter, layers={**adapter.layers, name: bigger})


def _misshapen(adapter: LoraAdapter) -> LoraAdapter:
    name, layer = next(iter(adapter.layers.items()))
    return dataclasses.replace(adapter, layers={**adapter.layers, name: dataclasses.replace(layer, lora_a=layer.lora_a[:, :-1])})


def _unknown_layer(adapter: LoraAdapter) -> LoraAdapter:
    layer = next(iter(adapter.layers.values()))
    return dataclasses.replace(adapter, layers={**adapter.layers, "model.layers.9.self_attn.q_proj.weight": layer})


def _non_finite(adapter: LoraAdapter) -> LoraAdapter:
    name, layer = next(iter(adapter.layers.items()))
    poisoned = layer.lora_b.clone()
    poisoned[0, 0] = float("nan")
    return dataclasses.replace(adapter, layers={**adapter.layers, name: dataclasses.replace(layer, lora_b=poisoned)})


@pytest.mark.parametrize(
    ("corrupt", "named"),
    [(_reranked, "rank 8 but the adapter's rank is 4"), (_misshapen, "do not fit the weight"),
     (_unknown_layer, "the model has no such weight"), (_non_finite, "non-finite")],
)
def test_a_bad_adapter_is_refused_with_nothing_changed(engine, peft_a, corrupt, named):
    engine.load_weights(lora_adapter(peft_a), version=1)
    before = weights_of(engine.model)
    with pytest.raises(ValueError, match=named):
        engine.load_weights(corrupt(lora_adapter(peft_a)), version=2)
    assert engine.version == 1
    for name, tensor in engine.model.state_dict().items():
        assert torch.equal(tensor, before[name]), name
    assert adapter_problems(lora_adapter(peft_a), engine.weight_metadata()[0]) == []


def test_unsupported_peft_configs_are_refused_naming_the_option(tiny_model_path):
    with pytest.raises(ValueError, match="use_dora"):
        lora_adapter(trained_lora(tiny_model_path, seed=3, steps=0, use_dora=True))
    with pytest.raises(TypeError, match="LoraConfig"):
        lora_adapter({"x.lora_A.weight": torch.zeros(1, 1)})


def test_a_collector_push_of_a_peft_model_loads_the_adapter_and_versions_the_turns(tiny_model_path, tokenizer, peft_a):
    from lmcollect.data import keys
    from lmcollect.envs import ChatEnv, MathAnswerReward, arithmetic_dataset

    policy = TransformersPolicy(perturbed_model(tiny_model_path, seed=1), tokenizer, max_new_tokens=4)
    env = ChatEnv(arithmetic_dataset(8, seed=0), reward_fn=MathAnswerReward(), batch_size=2)
    collector = LLMCollector(
        env, policy=policy, dialog_turns_per_batch=2, weight_updater=LocalWeightUpdater(), track_policy_version=True
    )
    try:
        collector.update_policy_weights_(peft_a)
        assert collector.weight_updater.version == 1
        assert_same_weights(policy.model, merged_copy(peft_a))
        batch = collector.next()
        assert set(batch[keys.POLICY_VERSION].flatten().tolist()) == {1}
        from lmcollect.diagnostics import check_logprobs

        report = check_logprobs(peft_a, batch)  # the trainer's peft model is the reference
        assert report.num_tokens > 0 and report.max_abs_diff < 1e-4, report.summary()
        base_report = check_logprobs(perturbed_model(tiny_model_path, seed=1), batch)
        assert base_report.max_abs_diff > 1e-3, "the adapter should change the log-probs"
    finally:
        collector.shutdown()
        policy.close()


def test_a_full_push_into_the_policys_model_is_the_base_of_the_next_adapter(tiny_model_path, tokenizer, peft_a):
    """The lockstep path writes full pushes into the model itself, not through the engine: the
    engine notices its last merge was overwritten and merges the next adapter into the new base."""
    policy = TransformersPolicy(perturbed_model(tiny_model_path, seed=1), tokenizer, max_new_tokens=4)
    collector = LLMCollector(_env(), policy=policy, dialog_turns_per_batch=2, weight_updater=LocalWeightUpdater())
    try:
        collector.update_policy_weights_(peft_a)
        new_base = perturbed_model(tiny_model_path, seed=6)
        collector.update_policy_weights_(new_base)
        assert_same_weights(policy.model, new_base)
        collector.update_policy_weights_(peft_a)
        for name, tensor in lora_adapter(peft_a).merged_into(new_base.state_dict()).items():
            torch.testing.assert_close(policy.model.state_dict()[name], tensor, rtol=0, atol=1e-6)
        assert collector.weight_updater.version == 3
    finally:
        collector.shutdown()
        policy.close()


def _env():
    from lmcollect.envs import ChatEnv, MathAnswerReward, arithmetic_dataset

    return ChatEnv(arithmetic_dataset(8, seed=0), reward_fn=MathAnswerReward(), batch_size=2)


def test_an_adapter_pushed_mid_turn_under_continuous_collection_versions_each_token(
    tiny_model_path, tokenizer, peft_a
) -> None:
    """The push lands between two decoding steps of a running turn: tokens before it carry version
    0 and the base's log-probs, tokens after it version 1 and the merged model's."""
    from lmcollect.collectors import ContinuousLLMCollector
    from lmcollect.data import keys
    from lmcollect.data.turns import flatten_turns
    from lmcollect.envs import ChatEnv, SingleTurnTask, arithmetic_dataset
    from tests.factories import run_in_thread
    from tests.unit.test_continuous import _forward_log_probs, wait_until

    base, merged = perturbed_model(tiny_model_path, seed=1), merged_copy(peft_a)
    engine = TransformersEngine(perturbed_model(tiny_model_path, seed=1), tokenizer)
    env = ChatEnv(arithmetic_dataset(8, seed=0), task=SingleTurnTask(), batch_size=1, seed=0)
    collector = ContinuousLLMCollector(
        [env], engine=engine, tokenizer=tokenizer, dialog_turns_per_batch=1, track_policy_version=True,
        sampling=SamplingConfig(max_new_tokens=160, temperature=0, ignore_eos=True),
    )
    try:
        join = run_in_thread(collector.next, timeout_s=120)
        wait_until(lambda: engine.num_in_flight == 1)
        time.sleep(0.05)
        collector.update_policy_weights_(peft_a)
        turn = flatten_turns(join())[0]
    finally:
        collector.shutdown()
        engine.close()
    versions = turn.get(keys.TOKEN_VERSIONS)
    assert set(versions.tolist()) == {0, 1}, "the adapter push should land mid-turn"
    full, num_prompt = turn.get(keys.TOKENS_FULL), turn.get(keys.TOKENS_PROMPT).numel()
    stored = turn.get(keys.LOG_PROBS_RESPONSE)
    for model, version in ((base, 0), (merged, 1)):
        segment = versions == version
        torch.testing.assert_close(stored[segment], _forward_log_probs(model, full, num_prompt)[segment], atol=1e-4, rtol=0)


# ---------------------------------------------------------------------- rank_pattern / alpha_pattern
PATTERNS = {"rank_pattern": {"v_proj": 8}, "alpha_pattern": {"q_proj": 32}}


@pytest.fixture(scope="module")
def peft_patterns(tiny_model_path):
    """q and v adapted, v at rank 8 (r=4 elsewhere), q with lora_alpha 32 (8 elsewhere)."""
    return trained_lora(tiny_model_path, seed=14, **PATTERNS)


def test_rank_and_alpha_patterns_give_each_layer_its_own_rank_and_scaling(tiny_model_path, peft_patterns):
    from peft import get_peft_model_state_dict

    adapter = lora_adapter(peft_patterns)
    assert adapter.rank == 4
    v_layers = [name for name in adapter.layers if ".v_proj." in name]
    assert v_layers and adapter.layer_ranks == dict.fromkeys(v_layers, 8)
    for name, layer in adapter.layers.items():
        rank, alpha = (8, 8) if ".v_proj." in name else (4, 32)
        assert layer.rank == rank and adapter.rank_of(name) == rank
        assert math.isclose(layer.scaling, alpha / rank), name
    from_state = lora_adapter(get_peft_model_state_dict(peft_patterns), peft_patterns.peft_config["default"])
    assert from_state.layer_ranks == adapter.layer_ranks
    for name, layer in adapter.layers.items():
        assert math.isclose(from_state.layers[name].scaling, layer.scaling), name
    back = pickle.loads(pickle.dumps(adapter))  # how Ray carries it
    assert back.layer_ranks == adapter.layer_ranks
    assert LoraAdapter.from_state(adapter.state()).layer_ranks == adapter.layer_ranks
    wrong = dataclasses.replace(adapter, layer_ranks={})  # the patterns' ranks dropped: refused
    assert any("rank 8 but the adapter's rank is 4" in p for p in adapter_problems(wrong, expected_of(peft_patterns)))


def expected_of(peft_model) -> dict:
    from lmcollect.weights.tensors import expected_metadata

    return expected_metadata(merged_copy(peft_model))[0]


@pytest.mark.parametrize("kind", ["lockstep", "continuous"])
def test_a_peft_model_with_rank_and_alpha_patterns_pushes_as_its_merged_model(kind, tiny_model_path, peft_patterns):
    from tests.lora_resume_worker import build, close, greedy_answers, model_of

    collector = build(kind, str(tiny_model_path))
    merged = merged_copy(peft_patterns)
    try:
        collector.update_policy_weights_(perturbed_model(tiny_model_path, seed=1))
        collector.update_policy_weights_(peft_patterns)
        assert_same_weights(model_of(collector), merged)
        assert greedy_answers(collector) == [generate_greedy(merged, list(p), 8, min_new_tokens=8) for p in PROMPTS]
        assert collector.weight_updater.last_push_stats.kind == "lora"
    finally:
        close(collector)


# ---------------------------------------------------------------------- push stats
def moved(stats: PushStats | None) -> PushStats:
    """What a push moved, less how long its call took (``call_s``, checked positive here)."""
    assert stats is not None and stats.call_s is not None and stats.call_s > 0
    return dataclasses.replace(stats, call_s=None)


@pytest.mark.parametrize("kind", ["lockstep", "continuous"])
def test_a_local_updater_reports_what_each_push_moved(kind, tiny_model_path, peft_a):
    from lmcollect.weights.delta import distinct_nbytes
    from tests.lora_resume_worker import build, close

    collector = build(kind, str(tiny_model_path))
    updater = collector.weight_updater
    assert isinstance(updater, LocalWeightUpdater) and updater.last_push_stats is None
    try:
        new_base = perturbed_model(tiny_model_path, seed=1)
        collector.update_policy_weights_(new_base)
        nbytes = distinct_nbytes(new_base.state_dict())
        assert moved(updater.last_push_stats) == PushStats.full(nbytes, num_full=1)
        collector.update_policy_weights_(peft_a)
        adapter = lora_adapter(peft_a)
        assert moved(updater.last_push_stats) == PushStats.lora(adapter.nbytes, num_receivers=1)
        assert updater.last_push_stats.kind == "lora" and updater.last_push_stats.nbytes < nbytes
    finally:
        close(collector)


def test_every_updater_has_last_push_stats_of_one_type(peft_a):
    """The base class sets them, so any updater (the shipped ones, or one of the user's own) has them."""
    from lmcollect.weight_sync import vLLMUpdater
    from lmcollect.weight_sync.base import WeightUpdaterBase

    class ListUpdater(WeightUpdaterBase[int]):  # an updater that only records what it is given
        def __init__(self) -> None:
            super().__init__()
            self.sent: list = []

        def all_worker_ids(self) -> list[int]:
            return [0, 1]

        def _adapter_metadata(self, worker_id: int) -> None:
            return None

        def _sync_weights_with_worker(self, *, worker_id, server_weights, version) -> None:
            self.sent.append((worker_id, version.index))

    for fresh in (LocalWeightUpdater(), vLLMUpdater(), ListUpdater()):
        assert fresh.last_push_stats is None, type(fresh).__name__
    updater = ListUpdater()
    updater.push_weights({"w": torch.zeros(4, 4)})
    assert moved(updater.last_push_stats) == PushStats.full(64, num_full=2)
    updater.push_weights(peft_a, worker_ids=[1])
    assert moved(updater.last_push_stats) == PushStats.lora(lora_adapter(peft_a).nbytes, num_receivers=1)
    assert updater.sent == [(0, 1), (1, 1), (1, 2)]
