"""Exactly-resumable collection: stop anywhere, restore in a new process, get the same data."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lmcollect.checkpoint import load_checkpoint, save_checkpoint
from lmcollect.collectors import LLMCollector
from lmcollect.data import codec
from lmcollect.testing import ScriptedEngine, ScriptedPolicy

from tests.resume_worker import build, collect

REPO_ROOT = Path(__file__).resolve().parents[2]


def _restore_elsewhere(kind: str, folder: Path, num_batches: int, out: Path, model_path: str | None = None) -> dict:
    """Restore ``folder`` in a fresh Python process, collect there, read back what it collected."""
    args = [sys.executable, "-m", "tests.resume_worker", kind, str(folder), str(num_batches), str(out)]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    subprocess.run(args + ([model_path] if model_path else []), cwd=REPO_ROOT, env=env, check=True, timeout=300)
    return codec.load(out)


def assert_same(a, b) -> None:
    """Every key of every turn (tensors, texts, histories), in order: tokens, flags and versions exactly,
    floats (log-probs) to 1e-5 - a forward pass in another process may run with another number of
    threads, which splits matmul sums differently (last-bit differences, not different weights)."""
    data_a, tensors_a = codec.encode(a)
    data_b, tensors_b = codec.encode(b)
    assert data_a == data_b
    assert tensors_a.keys() == tensors_b.keys()
    for name, tensor in tensors_a.items():
        other = tensors_b[name]
        assert tensor.dtype == other.dtype, name
        if tensor.is_floating_point():
            torch.testing.assert_close(tensor, other, rtol=0, atol=1e-5, msg=name)
        else:
            assert torch.equal(tensor, other), name


@pytest.mark.parametrize("stop_after", [1, 3])
def test_scripted_run_resumed_in_a_new_process_yields_the_same_data(tmp_path: Path, stop_after: int) -> None:
    uninterrupted, _ = build("scripted")
    expected = collect(uninterrupted, None, 6)
    first, _ = build("scripted")
    head = collect(first, None, stop_after)
    assert first.num_buffered_turns > 0 or stop_after == 3  # stopped with turns waiting for their batch
    save_checkpoint(tmp_path / "ckpt", [first])
    tail = _restore_elsewhere("scripted", tmp_path / "ckpt", 6 - stop_after, tmp_path / "out.safetensors")["turns"]
    assert_same(expected, head + tail)


def test_tiny_model_run_with_buffer_resumed_in_a_new_process(tmp_path: Path, tiny_model_path: Path) -> None:
    uninterrupted, buffer_a = build("tiny", str(tiny_model_path))
    expected = collect(uninterrupted, buffer_a, 5)
    samples_a = buffer_a.sample(8)
    first, buffer_b = build("tiny", str(tiny_model_path))
    head = collect(first, buffer_b, 2)
    save_checkpoint(tmp_path / "ckpt", [first], replay_buffer=buffer_b)
    out = _restore_elsewhere("tiny", tmp_path / "ckpt", 3, tmp_path / "out.safetensors", str(tiny_model_path))
    assert_same(expected, head + out["turns"])
    assert_same(samples_a, out["samples"])  # the buffer's contents and its sampling RNG came back too


def test_a_checkpoint_from_another_configuration_is_refused(tmp_path: Path) -> None:
    collector, _ = build("scripted")
    collect(collector, None, 1)
    save_checkpoint(tmp_path / "ckpt", [collector])
    from tests.factories import make_guesser, make_guessing_env

    other = LLMCollector(make_guessing_env, policy=make_guesser(), dialog_turns_per_batch=5, yield_completed_trajectories=True)
    with pytest.raises(ValueError, match=r"dialog_turns_per_batch=3 \(given collector: 5\)"):
        load_checkpoint(tmp_path / "ckpt", [other])
    with pytest.raises(ValueError, match="1 collector state"):
        load_checkpoint(tmp_path / "ckpt", [collector, collector])
    with pytest.raises(FileNotFoundError, match="no manifest.json"):
        load_checkpoint(tmp_path, [collector])
    with pytest.raises(ValueError, match="pass replay_buffer"):
        from lmcollect.buffers import ReplayBuffer

        save_checkpoint(tmp_path / "with-buffer", [collector], replay_buffer=ReplayBuffer(capacity=4))
        load_checkpoint(tmp_path / "with-buffer", [collector])


def test_a_checkpoint_holds_no_pickled_objects(tmp_path: Path) -> None:
    collector = LLMCollector(
        lambda: __import__("tests.factories", fromlist=["x"]).make_guessing_env(),
        policy=ScriptedPolicy("7"),
        dialog_turns_per_batch=2,
    )
    collector.next()
    save_checkpoint(tmp_path / "ckpt", [collector])
    (entry,) = json.loads((tmp_path / "ckpt" / "manifest.json").read_text())["collectors"]
    raw = (tmp_path / "ckpt" / entry["file"]).read_bytes()
    header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])  # safetensors: length, JSON header, raw tensors
    state = json.loads(header["__metadata__"]["lmcollect"])  # the rest of the state is plain JSON
    assert {"observations", "pending_turns", "rng", "trajectories", "env_state_dict"} <= set(state["items"])
    with pytest.raises(TypeError, match="without pickling"):
        codec.encode({"x": object()})


def test_vllm_policy_request_seeds_resume(tiny_model_path: Path) -> None:
    from lmcollect.policies.vllm_policy import VLLMPolicy

    engine = ScriptedEngine()  # never asked to generate: only the seed generator is exercised
    policy = VLLMPolicy(tiny_model_path, engine=engine, temperature=1.0, seed=3)
    policy._request_seeds.draw(5, greedy=False)
    saved = policy.rng_state()
    expected = policy._request_seeds.draw(4, greedy=False)
    fresh = VLLMPolicy(tiny_model_path, engine=engine, temperature=1.0, seed=99)
    fresh.set_rng_state(json.loads(json.dumps(saved)))  # survives a JSON round trip (checkpoints)
    assert fresh._request_seeds.draw(4, greedy=False) == expected
    engine.close()
