"""VLLMEngine(multiprocess=True): vLLM's engine core in a process of its own, so a push's bytes go to
its worker through a shared-memory file (``lmcollect.engines.shm_payload``), not through the RPC.

After a full push the engine answers as the pushed model (greedy tokens and log-probs); a LoRA
adapter then merges into that push's weights, which the worker holds as views of the mapped file
(removed from ``/dev/shm`` as soon as the push returned), and a checkpoint reads that base back from
the worker. Skipped where vLLM is not installed.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lmcollect.engines import EngineRequest
from lmcollect.engines.sampling import SamplingConfig
from lmcollect.engines.shm_payload import SHM_DIR
from tests.engine_contract import forward_log_probs, generate_greedy
from tests.factories import perturbed_model
from tests.integration.conftest import CPU_ENGINE_KWARGS

pytest.importorskip("vllm")
from lmcollect.engines.vllm_engine import VLLMEngine  # noqa: E402

pytestmark = pytest.mark.integration

PROMPT = [1, 2, 3, 4, 5]
ATOL = 1e-4


def push_files() -> set[Path]:
    return set(SHM_DIR.glob("lmcollect-push-*"))


def expect_answers_of(model: torch.nn.Module, engine: VLLMEngine) -> None:
    request = EngineRequest(prompt_ids=PROMPT, sampling=SamplingConfig(temperature=0.0, max_new_tokens=8, ignore_eos=True))
    result = engine.submit(request).result(120)
    assert result.tokens.tolist() == generate_greedy(model, PROMPT, 8, min_new_tokens=8)
    torch.testing.assert_close(result.log_probs, forward_log_probs(model, PROMPT, result.tokens.tolist()), atol=ATOL, rtol=0)


def test_pushes_reach_a_worker_in_another_process_through_shared_memory(tiny_model_path: Path) -> None:
    before = push_files()
    new = perturbed_model(tiny_model_path, seed=41).eval()
    engine = VLLMEngine(tiny_model_path, engine_kwargs=CPU_ENGINE_KWARGS, multiprocess=True, timeout_s=300)
    try:
        assert engine._workers_elsewhere  # the path under test
        engine.load_weights(new.state_dict().items(), version=1)
        assert push_files() == before, "the push's shared-memory file outlived the push"
        expect_answers_of(new, engine)
        peft = pytest.importorskip("peft")
        del peft
        from lmcollect.weights.lora import lora_adapter
        from tests.factories import merged_copy, trained_lora

        adapted = trained_lora(tiny_model_path, seed=42, base=perturbed_model(tiny_model_path, seed=41).eval())
        engine.load_weights(lora_adapter(adapted), version=2)  # merged into the mapped push's weights
        expect_answers_of(merged_copy(adapted), engine)
        base, held = engine.checkpoint_weights()  # what a checkpoint saves: the base comes back over the RPC
        assert base and all(torch.equal(base[name], t) for name, t in new.state_dict().items() if name in base)
        assert held is not None and held.layers.keys() == lora_adapter(adapted).layers.keys()
    finally:
        engine.close()
