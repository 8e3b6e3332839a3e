"""Session fixtures: one local Ray cluster, and the one in-process vLLM engine (tiny model), per pytest worker."""
from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tensordict import TensorDict, TensorDictBase, lazy_stack

from lmcollect.data.history import History

REPO_ROOT = Path(__file__).resolve().parents[2]
# vLLM on CPU: a small KV cache (the default does not fit) and no torch.compile (start-up in seconds).
CPU_ENGINE_KWARGS = {"kv_cache_memory_bytes": 1 << 30, "enforce_eager": True}
MAX_NEW_TOKENS = 24
QUESTIONS = ["What is 3 + 4?", "hello there", "Compute 12 * 7 and answer.", "x"]


def chat_batch(questions: list[str], system_prompt: str = "Be brief.") -> TensorDictBase:
    return lazy_stack(
        [TensorDict({"history": {"prompt": History.from_text(q, system_prompt=system_prompt)}}) for q in questions]
    )


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    if not ray.is_initialized():
        ray.init(
            address="local",  # a cluster of this test process's own (make test runs two, one per pytest worker)
            num_cpus=2,
            include_dashboard=False,
            # test modules must be importable inside actors (functions defined there are pickled by name)
            runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}},
        )
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def vllm_env() -> Iterator[None]:
    """vLLM in this process (a few seconds to start instead of ~20 s for its own processes)."""
    pytest.importorskip("vllm")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        yield


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory, tiny_model_path: Path) -> Path:
    """The tiny model with one extra eos id: a token its greedy answer to QUESTIONS[0] produces.

    A randomly initialised model never writes its real eos, so without this the stop-at-eos path
    (eos kept, shorter response) would go untested.
    """
    from lmcollect.data import keys
    from lmcollect.models import load_model_and_tokenizer
    from lmcollect.policies import TransformersPolicy

    folder = tmp_path_factory.mktemp("tiny-eos")
    shutil.copytree(tiny_model_path, folder, dirs_exist_ok=True)
    model, tokenizer = load_model_and_tokenizer(folder)
    reference = TransformersPolicy(model, tokenizer, temperature=0.0, max_new_tokens=MAX_NEW_TOKENS)
    extra_eos = int(reference(chat_batch(QUESTIONS[:1]))[0][keys.TOKENS_RESPONSE][-1])
    config_file = folder / "generation_config.json"
    config = json.loads(config_file.read_text())
    config["eos_token_id"] = [config["eos_token_id"], extra_eos]
    config_file.write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="session")
def greedy_policy(vllm_env: None, model_dir: Path) -> Any:
    """The session's one in-process engine, built by the policy; other policies share it."""
    from lmcollect.policies.vllm_policy import VLLMPolicy
    from tests.vllm_hold import HOLDING_EXTENSION

    # the weight-receiver extension (test_vllm_updater pushes into this engine too) with the
    # engine contract's hold hook (test_vllm_engine)
    engine_kwargs = {**CPU_ENGINE_KWARGS, "worker_extension_cls": HOLDING_EXTENSION}
    return VLLMPolicy(model_dir, engine_kwargs=engine_kwargs, temperature=0.0, max_new_tokens=MAX_NEW_TOKENS)


@pytest.fixture(scope="session")
def engine(greedy_policy: Any) -> Any:
    from lmcollect.engines.vllm.engine import VLLMEngine

    assert isinstance(greedy_policy.engine, VLLMEngine)
    return greedy_policy.engine
