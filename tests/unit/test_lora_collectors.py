"""LoRA pushes through both collectors (lockstep TransformersPolicy, continuous TransformersEngine):
one base rule (a full push, whatever its values, is a new base; adapters replace each other on top
of it), and checkpoints that keep it: a restore, in this process or a new one, followed by adapter
pushes gives exactly what the uninterrupted run gives, which is peft's merge_and_unload()."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lmcollect.checkpoint import save_checkpoint
from lmcollect.data import codec
from lmcollect.weights.lora import lora_adapter
from tests.engine_contract import generate_greedy
from tests.factories import merged_copy, perturbed_model, trained_lora
from tests.lora_resume_worker import (
    KINDS,
    PROMPTS,
    after_restore,
    build,
    close,
    collect,
    greedy_answers,
    model_of,
    weights_of,
)
from tests.unit.test_resume import assert_same

pytest.importorskip("peft", reason="LoRA tests need the lora extra: pip install 'lmcollect[lora]'")

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def base(tiny_model_path) -> torch.nn.Module:
    """The base the adapters train on, pushed in full first (not the weights the collectors are built with)."""
    return perturbed_model(tiny_model_path, seed=1).eval()


@pytest.fixture(scope="module")
def peft_a(tiny_model_path):
    return trained_lora(tiny_model_path, seed=11)  # q/v, on perturbed_model(seed=1)


@pytest.fixture(scope="module")
def peft_b(tiny_model_path):
    """Overlaps A (q_proj), leaves one of A's layers (v_proj) and adds one (o_proj): stacking on A's q,
    or keeping A's v, would both show."""
    return trained_lora(tiny_model_path, seed=12, targets=("q_proj", "o_proj"))


def assert_weights_of(collector, reference: torch.nn.Module, atol: float = 1e-6) -> None:
    expected = reference.state_dict()
    for name, tensor in model_of(collector).state_dict().items():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=atol, msg=name)


def assert_answers_of(collector, reference: torch.nn.Module) -> None:
    want = [generate_greedy(reference, list(p), 8, min_new_tokens=8) for p in PROMPTS]
    assert greedy_answers(collector) == want


def assert_equal_weights(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, tensor in got.items():
        assert torch.equal(tensor, want[name]), name


def save_paused(folder: Path, collectors: list) -> None:
    """save_checkpoint with the collectors paused (the continuous one's dialogs between two turns)."""
    with collectors[0].pause(), collectors[1].pause():
        save_checkpoint(folder, collectors)


# ---------------------------------------------------------------------- the base rule
@pytest.mark.parametrize("kind", KINDS)
def test_a_full_push_of_the_merged_weights_is_a_new_base_in_both_collectors(kind, tiny_model_path, base, peft_a) -> None:
    """Push A, then the merged model in full (the very values served), then B: B merges on top of
    merged A, in lockstep and continuous alike (peft: B trained on merge_and_unload() of A)."""
    merged_a = merged_copy(peft_a)
    peft_on_merged = trained_lora(tiny_model_path, seed=13, targets=("q_proj", "o_proj"), base=merged_copy(peft_a))
    collector = build(kind, str(tiny_model_path))
    try:
        collector.update_policy_weights_(base)
        collector.update_policy_weights_(peft_a)
        assert_weights_of(collector, merged_a)
        collector.update_policy_weights_(merged_a)  # exactly what is served: still a new base
        collector.update_policy_weights_(peft_on_merged)
        assert_weights_of(collector, merged_copy(peft_on_merged))
        assert_answers_of(collector, merged_copy(peft_on_merged))
        assert collector.version_index() == 4
    finally:
        close(collector)


@pytest.mark.parametrize("kind", KINDS)
def test_adapters_replace_each_other_on_the_pushed_base(kind, tiny_model_path, base, peft_a, peft_b) -> None:
    collector = build(kind, str(tiny_model_path))
    try:
        collector.update_policy_weights_(base)
        collector.update_policy_weights_(peft_a)
        collector.update_policy_weights_(peft_b)  # q replaced, v back to the base, o adapted
        assert_weights_of(collector, merged_copy(peft_b))
        assert_answers_of(collector, merged_copy(peft_b))
    finally:
        close(collector)


# ---------------------------------------------------------------------- checkpoints
@pytest.mark.parametrize("kind", KINDS)
def test_a_state_holds_the_base_and_the_adapter_and_restores_both(kind, tiny_model_path, base, peft_a, peft_b) -> None:
    """The state's weights are the pushed base (not the merge) and the adapter on it; restored into a
    fresh collector, it serves base + A, and B then replaces A (no stacking)."""
    first, fresh = build(kind, str(tiny_model_path)), build(kind, str(tiny_model_path))
    try:
        first.update_policy_weights_(base)
        first.update_policy_weights_(peft_a)
        with first.pause():
            state = first.state_dict()
        assert_equal_weights({k: state["policy_state_dict"][k] for k in base.state_dict()}, dict(base.state_dict()))
        assert state["lora_adapter"]["scalings"].keys() == lora_adapter(peft_a).layers.keys()
        fresh.load_state_dict(state)
        assert_equal_weights(weights_of(fresh), weights_of(first))
        assert fresh.version_index() == first.version_index() == 2
        fresh.update_policy_weights_(peft_b)
        first.update_policy_weights_(peft_b)
        assert_equal_weights(weights_of(fresh), weights_of(first))
        assert_weights_of(fresh, merged_copy(peft_b))
    finally:
        close(first)
        close(fresh)


def _misshapen(tensors: dict, name: str) -> None:
    tensors[f"{name}.lora_A"] = torch.zeros(4, 3)


def _overflowing(tensors: dict, name: str) -> None:
    """Finite factors whose merge into the saved base is not (every element of B @ A is 4e40)."""
    for half in "AB":
        tensors[f"{name}.lora_{half}"] = torch.full_like(tensors[f"{name}.lora_{half}"], 1e20)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("corrupt", "named"), [(_misshapen, "does not fit"), (_overflowing, "not finite")])
def test_a_state_whose_adapter_is_refused_changes_nothing(kind, corrupt, named, tiny_model_path, base, peft_a) -> None:
    first, fresh = build(kind, str(tiny_model_path)), build(kind, str(tiny_model_path))
    try:
        first.update_policy_weights_(base)
        first.update_policy_weights_(peft_a)
        with first.pause():
            state = first.state_dict()
        corrupt(state["lora_adapter"]["tensors"], next(iter(state["lora_adapter"]["scalings"])))
        before = weights_of(fresh)
        with pytest.raises(ValueError, match=named):
            fresh.load_state_dict(state)
        assert_equal_weights(weights_of(fresh), before)
        assert fresh.version_index() == 0
    finally:
        close(first)
        close(fresh)


def test_a_restore_in_a_new_process_then_an_adapter_push_equals_the_uninterrupted_run(
    tmp_path, tiny_model_path, base, peft_a, peft_b
) -> None:
    """Both collectors: push the base, adapter A, collect; checkpoint; in a new process, restore, push
    B, collect. The weights, greedy answers, versions (and the lockstep turns) equal those of the
    run that never stopped, whose weights are peft's merge of B."""
    path = str(tiny_model_path)
    uninterrupted = [build(kind, path) for kind in KINDS]
    first = [build(kind, path) for kind in KINDS]
    try:
        heads = {}
        for kind, run, stopped in zip(KINDS, uninterrupted, first, strict=True):
            for collector in (run, stopped):
                collector.update_policy_weights_(base)
                collector.update_policy_weights_(peft_a)
            heads[kind] = (collect(run, 1), collect(stopped, 1))
        expected = {kind: after_restore(run, lora_adapter(peft_b), 2) for kind, run in zip(KINDS, uninterrupted, strict=True)}
        save_paused(tmp_path / "ckpt", first)
    finally:
        for collector in uninterrupted + first:
            close(collector)
    codec.save(tmp_path / "adapter_b.safetensors", lora_adapter(peft_b).state())
    args = ["tests.lora_resume_worker", str(tmp_path / "ckpt"), str(tmp_path / "adapter_b.safetensors"), path]
    out = tmp_path / "out.safetensors"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    subprocess.run([sys.executable, "-m", *args, str(out)], cwd=REPO_ROOT, env=env, check=True, timeout=300)
    resumed = codec.load(out)
    merged_b = merged_copy(peft_b)
    for kind in KINDS:
        got, want = resumed[kind], expected[kind]
        assert_equal_weights(got["weights"], want["weights"])
        for name, tensor in merged_b.state_dict().items():
            torch.testing.assert_close(got["weights"][name], tensor, rtol=0, atol=1e-6, msg=f"{kind}: {name}")
        assert got["answers"] == want["answers"] == [generate_greedy(merged_b, list(p), 8, min_new_tokens=8) for p in PROMPTS]
        assert got["version"] == want["version"] == 3
    assert_same(heads["lockstep"][0], heads["lockstep"][1])
    assert_same(expected["lockstep"]["turns"], resumed["lockstep"]["turns"])
