"""The collectors' KV policy: what a push mid-turn does to the keys/values, as turns, costs and check_logprobs record it.

The engines' own checks are the engine contract's ``kv_policies`` (tests/engine_contract.py)."""
from __future__ import annotations

import time

import pytest
import torch

from lmcollect.collectors import ContinuousLLMCollector
from lmcollect.data import keys
from lmcollect.data.turns import flatten_turns
from lmcollect.diagnostics import check_logprobs
from lmcollect.engines import TransformersEngine
from lmcollect.engines.kv_policy import PushCostMeter, check_kv_policy, kv_versions_of
from lmcollect.engines.protocol import EngineRequest, EngineResult
from lmcollect.engines.vllm.kv import VLLMKVBook
from lmcollect.engines.sampling import SamplingConfig
from lmcollect.envs import ChatEnv, SingleTurnTask, arithmetic_dataset
from lmcollect.testing import ByteTokenizer, ScriptedEngine
from tests.factories import perturbed_model, run_in_thread


def wait_until(condition, timeout_s: float = 60.0, what: str = "the condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"waited {timeout_s} s for {what}"
        time.sleep(0.005)


def test_kv_versions_are_the_tokens_own_under_recompute_and_the_contexts_floor_under_keep() -> None:
    versions = torch.tensor([3, 3, 4, 4, 5])
    assert kv_versions_of(versions, kv_policy="recompute").tolist() == [3, 3, 4, 4, 5]
    assert kv_versions_of(versions, kv_policy="keep").tolist() == [3] * 5
    assert kv_versions_of(versions, kv_policy="keep", context_kv_version=1).tolist() == [1] * 5
    with pytest.raises(ValueError, match=r"kv_policy must be one of \['recompute', 'keep'\], got 'fast'"):
        check_kv_policy("fast")


def test_the_meter_adds_each_recompute_to_its_own_push() -> None:
    meter = PushCostMeter(keep=2)
    meter.loaded(version=1, kv_policy="recompute", call_s=0.5)
    meter.loaded(version=2, kv_policy="recompute", call_s=0.25)
    meter.recomputed(10, 0.1, version=1)
    meter.recomputed(7, 0.2)  # the latest push
    meter.loaded(version=3, kv_policy="keep", call_s=0.1)  # the oldest falls out
    assert [(c.version, c.recomputed_tokens, c.recompute_s) for c in meter.costs()] == [(2, 7, 0.2), (3, 0, 0.0)]
    assert meter.last is not None and meter.last.as_metrics()["push/call_s"] == 0.1


def test_the_meter_keeps_each_pushs_timeline_and_its_first_step() -> None:
    meter = PushCostMeter()
    meter.loaded(version=1, kv_policy="keep", call_s=0.3, copy_s=0.05, wait_s=0.02, load_s=0.28, reset_s=0.02)
    meter.first_step(0.04, version=1)
    cost = meter.costs()[-1]
    assert (cost.copy_s, cost.wait_s, cost.load_s, cost.reset_s, cost.first_step_s) == (0.05, 0.02, 0.28, 0.02, 0.04)
    assert cost.total_s == pytest.approx(0.37) and cost.stall_s == 0.3
    assert cost.as_metrics()["push/first_step_s"] == 0.04
    assert cost.timeline().startswith("copy 50 ms, wait 20 ms, load 280 ms, reset 20 ms, first step 40 ms")


def salted(book: VLLMKVBook, name: str, *, version: int, context: int | None = None) -> str | None:
    request = EngineRequest(prompt_ids=list(range(40)), affinity=name, context_kv_version=context)
    return book.added(name, request, version=version)


def test_keep_salts_the_prefix_cache_by_the_oldest_version_of_the_context() -> None:
    book = VLLMKVBook("keep")
    # a group's siblings: first turns of one version share one salt, so their prompt's keys/values
    assert salted(book, "a", version=3) == salted(book, "b", version=3) == "kv-version:3"
    # a dialog's next turn after a push reuses its own context's salt (its prefix), and records it
    assert salted(book, "a2", version=5, context=3) == "kv-version:3"
    result = EngineResult(
        tokens=torch.tensor([1, 2]), log_probs=torch.zeros(2), token_versions=torch.tensor([5, 5]), finish_reason="stop"
    )
    assert book.finished("a2", result, num_cached=32).kv_versions.tolist() == [3, 3]
    salted(book, "a3", version=5, context=3)
    assert book.finished("a3", result, num_cached=0).kv_versions.tolist() == [5, 5]  # nothing reused
    assert salted(VLLMKVBook("recompute"), "c", version=5, context=3) is None  # a load empties the cache


def test_a_collector_over_an_engine_that_cannot_keep_refuses_keep_naming_the_fix() -> None:
    env = ChatEnv(arithmetic_dataset(4, seed=0), task=SingleTurnTask(), batch_size=1, seed=0)
    with pytest.raises(ValueError, match="ScriptedEngine cannot keep keys/values.*use kv_policy='recompute'"):
        ContinuousLLMCollector([env], engine=ScriptedEngine(), tokenizer=ByteTokenizer(), dialog_turns_per_batch=1, kv_policy="keep")


def push_mid_turn(tiny_model_path, kv_policy: str):
    """One long turn of a continuous collector with ``kv_policy``, a push landing in it; (turn, collector costs, old, new)."""
    from lmcollect.models import load_model_and_tokenizer

    tokenizer = load_model_and_tokenizer(tiny_model_path)[1]
    old, new = perturbed_model(tiny_model_path, seed=1), perturbed_model(tiny_model_path, seed=2)
    engine = TransformersEngine(perturbed_model(tiny_model_path, seed=1), tokenizer)
    env = ChatEnv(arithmetic_dataset(8, seed=0), task=SingleTurnTask(), batch_size=1, seed=0)
    collector = ContinuousLLMCollector(
        [env], engine=engine, tokenizer=tokenizer, dialog_turns_per_batch=1, track_policy_version=True,
        sampling=SamplingConfig(max_new_tokens=160, temperature=0, ignore_eos=True), kv_policy=kv_policy,
    )  # fmt: skip
    join = run_in_thread(collector.next, timeout_s=120)
    wait_until(lambda: engine.num_in_flight == 1, what="the turn to start")
    time.sleep(0.05)
    collector.update_policy_weights_(new)  # lands between two decoding steps of the running turn
    batch = join()
    costs = collector.push_costs()
    collector.shutdown()
    engine.close()
    return batch, costs, old, new


@pytest.mark.parametrize("kv_policy", ["recompute", "keep"])
def test_a_push_mid_turn_under_each_policy_is_recorded_costed_and_reported(tiny_model_path, kv_policy: str) -> None:
    batch, costs, old, new = push_mid_turn(tiny_model_path, kv_policy)
    turn = flatten_turns(batch)[0]
    versions, kv = turn.get(keys.TOKEN_VERSIONS), turn.get(keys.KV_VERSIONS)
    assert set(versions.tolist()) == {0, 1}, "the push should land mid-turn"
    switch = versions.tolist().index(1)
    num_prompt = turn.get(keys.TOKENS_PROMPT).numel()
    assert costs[-1].version == 1 and costs[-1].kv_policy == kv_policy and costs[-1].call_s > 0
    report = check_logprobs(new, batch)  # the trainer after the push
    new_segment = versions == 1
    if kv_policy == "recompute":
        assert torch.equal(kv, versions)
        assert costs[-1].recomputed_tokens == num_prompt + switch and costs[-1].recompute_s > 0
        assert report.num_stale_context_tokens == 0
    else:
        assert set(kv.tolist()) == {0}  # every token attended to the prompt's keys/values of version 0
        assert costs[-1].recomputed_tokens == 0 and costs[-1].recompute_s == 0
        assert report.num_stale_context_tokens == int(new_segment.sum())
        assert report.max_abs_diff > 1e-3  # the new segment is not what the new weights give over its context
    old_report = check_logprobs(old, batch)
    assert old_report.num_stale_context_tokens == report.num_stale_context_tokens
