"""VLLMEngine(multiprocess=True): vLLM's engine core in a process of its own, so a push's bytes go to
its worker through shared memory (``lmcollect.engines.vllm.shm_payload``), not through the RPC.

The engine packs every push into one of two files under ``/dev/shm`` that it keeps from push to
push (the worker maps each once) and removes when it closes. After a full push the engine answers
as the pushed model (greedy tokens and log-probs); a push refused after it was packed leaves the
worker's base (the other file) as it was, so a LoRA adapter still merges into the last accepted
push, and a checkpoint reads that base back from the worker. Skipped where vLLM is not installed.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from lmcollect.engines import EngineRequest, StalePushError
from lmcollect.engines.sampling import SamplingConfig
from lmcollect.engines.vllm.shm_payload import SHM_DIR
from lmcollect.weights.buckets import pack_buckets, packs_made
from tests.engine_contract import forward_log_probs, generate_greedy
from tests.factories import perturbed_model
from tests.integration.conftest import CPU_ENGINE_KWARGS

pytest.importorskip("vllm")
from lmcollect.engines.vllm.engine import VLLMEngine  # noqa: E402

pytestmark = pytest.mark.integration

PROMPT = [1, 2, 3, 4, 5]
ATOL = 1e-4


def push_files() -> set[Path]:
    """This process's push files (other processes on the machine may have their own)."""
    return set(SHM_DIR.glob(f"lmcollect-push-{os.getpid()}-*"))


def expect_answers_of(model: torch.nn.Module, engine: VLLMEngine) -> None:
    request = EngineRequest(prompt_ids=PROMPT, sampling=SamplingConfig(temperature=0.0, max_new_tokens=8, ignore_eos=True))
    result = engine.submit(request).result(120)
    assert result.tokens.tolist() == generate_greedy(model, PROMPT, 8, min_new_tokens=8)
    torch.testing.assert_close(result.log_probs, forward_log_probs(model, PROMPT, result.tokens.tolist()), atol=ATOL, rtol=0)


def test_pushes_pack_into_two_shared_files_kept_from_push_to_push(tiny_model_path: Path) -> None:
    peft = pytest.importorskip("peft")
    del peft
    from lmcollect.weights.lora import lora_adapter
    from tests.factories import merged_copy, trained_lora

    before = push_files()
    new, other = (perturbed_model(tiny_model_path, seed=seed).eval() for seed in (41, 43))
    engine = VLLMEngine(tiny_model_path, engine_kwargs=CPU_ENGINE_KWARGS, multiprocess=True, timeout_s=300)
    try:
        assert engine._workers_elsewhere  # the path under test
        engine.load_weights(other.state_dict().items(), version=1)  # packed into set 0
        engine.load_weights(new.state_dict().items(), version=2)  # set 1: the worker's base now
        files = push_files() - before
        assert len(files) == 2 and all(path.stat().st_mode & 0o777 == 0o600 for path in files)
        expect_answers_of(new, engine)
        with pytest.raises(StalePushError):  # packed into set 0 (over version 1's bytes), then refused
            engine.load_weights(other.state_dict().items(), version=1)
        expect_answers_of(new, engine)
        # merged into the worker's base: still version 2's set, untouched by the refused push
        adapted = trained_lora(tiny_model_path, seed=42, base=perturbed_model(tiny_model_path, seed=41).eval())
        engine.load_weights(lora_adapter(adapted), version=3)
        expect_answers_of(merged_copy(adapted), engine)
        base, held = engine.checkpoint_weights()  # what a checkpoint saves: the base comes back over the RPC
        assert base and all(torch.equal(base[name], t) for name, t in new.state_dict().items() if name in base)
        assert held is not None and held.layers.keys() == lora_adapter(adapted).layers.keys()
        buckets = pack_buckets(new.state_dict()).to_numpy()  # a sender's buckets (a Ray push's object)
        packs = packs_made()
        engine.load_weights(buckets, version=4)  # set 0 again: their buffers copied as they are, not packed
        assert packs_made() == packs
        expect_answers_of(new, engine)
        check_the_push_timeline_and_a_non_finite_push(engine, new)
        assert push_files() - before == files, "a push made a shared-memory file of its own"
        check_keep_across_a_push(engine, other)
    finally:
        engine.close()
    assert push_files() == before, "the engine's shared-memory files outlived it"


def check_the_push_timeline_and_a_non_finite_push(engine: VLLMEngine, held: torch.nn.Module) -> None:
    """The last push's timeline adds up (the stall is the load and the reset), and a push holding a NaN,
    refused by the check that rides on the copy into the spare set, changes nothing."""
    cost = engine.push_costs()[-1]
    assert cost.version == 4 and cost.copy_s > 0 and cost.load_s > 0 and cost.wait_s >= 0 and cost.reset_s >= 0
    assert cost.call_s == pytest.approx(cost.load_s + cost.reset_s, abs=2e-3) and cost.stall_s == cost.call_s
    assert cost.total_s == pytest.approx(cost.copy_s + cost.wait_s + cost.call_s)
    spoiled = dict(held.state_dict())  # tied tensors stay tied: the push has the layout of the held one
    name = next(name for name in spoiled if "q_proj.weight" in name)
    spoiled[name] = spoiled[name].detach().clone()
    spoiled[name].view(-1)[7] = float("nan")
    with pytest.raises(ValueError, match=f"{name}.*hold NaN or infinite values"):
        engine.load_weights(spoiled.items(), version=5, check_finite=True)
    assert engine.version == 4 and engine.push_costs()[-1].version == 4
    expect_answers_of(held, engine)


def check_keep_across_a_push(engine: VLLMEngine, pushed: torch.nn.Module) -> None:
    """kv_policy="keep" with the engine core in another process: a dialog's prefix cached under the old
    weights is reused by its own next turn (and says so in kv_versions), never by another dialog."""
    engine.set_kv_policy("keep")
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=4, ignore_eos=True)
    prompt = list(range(5, 150))  # longer than one prefix-cache block (128 tokens on CPU)
    first = engine.submit(EngineRequest(prompt_ids=prompt, sampling=greedy, affinity="a")).result(120)
    engine.load_weights(pushed.state_dict().items(), version=5)
    context = prompt + first.tokens.tolist()
    other = engine.submit(EngineRequest(prompt_ids=context, sampling=greedy, affinity="b")).result(120)
    assert other.num_cached_prompt_tokens == 0 and set(other.kv_versions.tolist()) == {5}
    torch.testing.assert_close(other.log_probs, forward_log_probs(pushed, context, other.tokens.tolist()), atol=ATOL, rtol=0)
    later = engine.submit(
        EngineRequest(prompt_ids=context, sampling=greedy, affinity="a", context_kv_version=4)
    ).result(120)
    assert later.num_cached_prompt_tokens > 0 and set(later.kv_versions.tolist()) == {4}
    assert engine.push_costs()[-1].recomputed_tokens == 0 and not engine.push_costs()[-1].recompute_timed
    engine.set_kv_policy("recompute")
