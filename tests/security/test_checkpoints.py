"""Checkpoints: a save that crashes midway leaves the earlier one whole; a manifest cannot point outside its
folder; a load is all or nothing (every state checked first, NaN weights refused, no symbolic links followed)."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from lmcollect.buffers.replay_buffer import ReplayBuffer
from lmcollect.checkpoint import load_checkpoint, save_checkpoint
from lmcollect.collectors import LLMCollector
from lmcollect.data import codec, keys
from lmcollect.data.turns import flatten_turns
from lmcollect.testing import ScriptedPolicy
from tests.factories import SmallModelPolicy, make_arithmetic_env, make_guessing_env


def build() -> LLMCollector:
    return LLMCollector(make_guessing_env, policy=ScriptedPolicy("7"), dialog_turns_per_batch=2)


def ids(batch) -> list[tuple[int, int]]:
    return [(int(t.get(keys.TRAJ_IDS)), int(t.get(keys.STEP_COUNT))) for t in flatten_turns(batch)]


def test_a_save_that_crashes_midway_leaves_the_earlier_checkpoint_whole(tmp_path: Path, monkeypatch) -> None:
    first, second = build(), build()
    first.next()
    save_checkpoint(tmp_path, [first, second])
    expected = ids(first.next())  # what a collector restored from the first save yields next
    first.next()

    real_save, calls = codec.save, []

    def crash_on_the_second_file(path, state):
        calls.append(path)
        if len(calls) == 2:
            raise OSError("disk full")  # the first collector's new file is written, the second's is not
        real_save(path, state)

    monkeypatch.setattr(codec, "save", crash_on_the_second_file)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(tmp_path, [first, second])
    monkeypatch.setattr(codec, "save", real_save)

    restored = [build(), build()]
    load_checkpoint(tmp_path, restored)  # the first save's manifest and files, not a mix
    assert ids(restored[0].next()) == expected
    save_checkpoint(tmp_path, [first, second])  # a later save cleans up what the crashed one left
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == sorted(e["file"] for e in manifest["collectors"])


def test_the_tmp_files_of_saves_killed_mid_write_are_removed_by_the_next_save(tmp_path: Path, monkeypatch) -> None:
    """Found by the chaos harness (benchmarks/chaos.py, a SIGKILL inside save_checkpoint): a save killed while
    writing a state file leaves ``<file>.safetensors.tmp``, one killed before the manifest's replace leaves
    ``manifest.json.<id>.tmp``, and safetensors' Rust writer its ``.tmpXXXXXX``; later saves removed none
    of them, so they piled up in the folder."""
    import safetensors.torch

    from lmcollect import checkpoint

    collector, buffer = build(), ReplayBuffer(capacity=8)
    collector.next()
    save_checkpoint(tmp_path, [collector], replay_buffer=buffer)

    def killed_mid_write(tensors, filename, metadata=None):
        raise OSError("killed")  # codec.save created the .tmp file, then the process died

    with monkeypatch.context() as patch:
        patch.setattr(safetensors.torch, "save_file", killed_mid_write)
        with pytest.raises(OSError, match="killed"):
            save_checkpoint(tmp_path, [collector], replay_buffer=buffer)
    real_replace = os.replace

    def killed_before_the_manifest_replace(src, dst):
        if Path(src).name.startswith("manifest.json."):
            raise OSError("killed")  # the new manifest is written under its .tmp name, not yet in place
        real_replace(src, dst)

    with monkeypatch.context() as patch:
        patch.setattr(checkpoint.os, "replace", killed_before_the_manifest_replace)
        with pytest.raises(OSError, match="killed"):
            save_checkpoint(tmp_path, [collector], replay_buffer=buffer)
    left = sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp"))
    assert any(name.startswith("manifest.json.") for name in left) and any(".safetensors." in n for n in left)
    (tmp_path / ".tmpAb12Cd").write_bytes(b"\0" * 64)  # safetensors' own temp file (Rust), of a write killed midway
    save_checkpoint(tmp_path, [collector], replay_buffer=buffer)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    buffer_entry = manifest["replay_buffer"]
    named = {e["file"] for e in manifest["collectors"] + buffer_entry["segments"]} | {buffer_entry["file"]}
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(named | {"manifest.json", ".save.lock"})


@pytest.mark.parametrize("name", ["../outside.safetensors", "/etc/passwd", "sub/collector-0.safetensors", "..", ""])
def test_a_manifest_naming_a_file_outside_its_folder_is_refused(tmp_path: Path, name: str) -> None:
    collector = build()
    collector.next()
    save_checkpoint(tmp_path / "ckpt", [collector])
    manifest_path = tmp_path / "ckpt" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["collectors"][0]["file"] = name
    manifest_path.write_text(json.dumps(manifest))
    target = build()
    before = target.state_dict()["turns_run"]
    with pytest.raises(ValueError, match="plain file names"):
        load_checkpoint(tmp_path / "ckpt", [target])
    assert target.state_dict()["turns_run"] == before == 0


# ---------------------------------------------------------------------- all or nothing (issue 42, items 8-10)
def build_with_weights() -> LLMCollector:
    return LLMCollector(make_arithmetic_env(), policy=SmallModelPolicy(), dialog_turns_per_batch=2, track_policy_version=True)


def snapshot(collector: LLMCollector) -> tuple:
    """What a load would change: the weights, the version, the turn counters and trajectory ids."""
    state = collector.state_dict()
    weights = {k: v.clone() for k, v in collector.get_policy_model().state_dict().items()}
    return weights, collector.policy_version, state["turns_run"], state["batches"], state["trajectories"]["next_id"]


def same_snapshot(a: tuple, b: tuple) -> bool:
    return a[0].keys() == b[0].keys() and all(torch.equal(a[0][k], b[0][k]) for k in a[0]) and a[1:] == b[1:]


def saved_run(folder: Path, *, with_buffer: bool = False) -> list[LLMCollector]:
    """Two collectors that took a push (version 1, weights all 2.0) and collected, saved into ``folder``."""
    collectors = [build_with_weights(), build_with_weights()]
    buffer = ReplayBuffer(capacity=8, seed=0) if with_buffer else None
    for collector in collectors:
        collector.receive_weights({k: torch.full_like(v, 2.0) for k, v in collector.get_policy_model().state_dict().items()})
        batch = collector.next()
        if buffer is not None:
            buffer.extend(batch.reshape(-1))
    save_checkpoint(folder, collectors, replay_buffer=buffer)
    return collectors


def rewrite_state(folder: Path, which: str, change) -> None:
    """Load the state file ``which`` ("collectors.1", "replay_buffer") names, ``change`` it, write it back."""
    manifest = json.loads((folder / "manifest.json").read_text())
    kind, _, index = which.partition(".")
    entry = manifest[kind][int(index)] if index else manifest[kind]
    state = codec.load(folder / entry["file"])
    change(state)
    codec.save(folder / entry["file"], state)


def malformed_slots(state) -> None:
    state["trajectories"]["slots"] = [{"no_such_field": 1}]  # loaded after the weights, version and counters


def cursor_out_of_range(state) -> None:
    state["cursor"] = 99


@pytest.mark.parametrize(
    ("which", "change", "reason"),
    [
        ("collectors.1", malformed_slots, r"collector 1's state was refused.*at 'trajectories'"),
        ("replay_buffer", cursor_out_of_range, r"cursor=99 is outside"),
    ],
    ids=["second_collector", "replay_buffer"],
)
def test_a_checkpoint_with_one_state_malformed_after_the_weights_changes_nothing_anywhere(tmp_path: Path, which, change, reason) -> None:
    saved_run(tmp_path / "ckpt", with_buffer=True)
    rewrite_state(tmp_path / "ckpt", which, change)
    targets, buffer = [build_with_weights(), build_with_weights()], ReplayBuffer(capacity=8, seed=0)
    before = [snapshot(c) for c in targets]
    with pytest.raises(ValueError, match=reason):
        load_checkpoint(tmp_path / "ckpt", targets, replay_buffer=buffer)
    assert all(same_snapshot(snapshot(c), b) for c, b in zip(targets, before, strict=True))
    assert len(buffer) == 0 and buffer.state_dict()["cursor"] == 0


def test_a_state_malformed_after_its_weights_is_refused_by_load_state_dict_with_nothing_changed(tmp_path: Path) -> None:
    source = saved_run(tmp_path / "ckpt")[0]
    state = source.state_dict()
    state["pending_turns"]["per_slot"][0] = [{"slot": 0, "traj_id": "seven", "done": False, "td": None}]
    target = build_with_weights()
    before = snapshot(target)
    with pytest.raises(ValueError, match=r"refused at 'pending_turns', nothing was changed.*traj_id='seven'"):
        target.load_state_dict(state)
    assert same_snapshot(snapshot(target), before)


def test_a_continuous_collectors_state_malformed_after_its_weights_changes_nothing() -> None:
    from lmcollect.collectors import ContinuousLLMCollector
    from lmcollect.policies import SamplingConfig
    from lmcollect.testing.scripted_engine import ByteTokenizer, ScriptedEngine

    def build() -> ContinuousLLMCollector:
        return ContinuousLLMCollector(
            [make_arithmetic_env()], engine=ScriptedEngine(), tokenizer=ByteTokenizer(),
            sampling=SamplingConfig(max_new_tokens=8), dialog_turns_per_batch=4, track_policy_version=True,
        )

    source, target = build(), build()
    try:
        source.receive_weights({"tag": torch.tensor([2.0])})
        source.next()
        with source.pause():
            state = source.state_dict()
        state["pending_turns"]["num_batches"] = "many"  # restored after the weights and the version
        before = (target.engine.model.tag.item(), target.policy_version, target.turns_run)
        with pytest.raises(ValueError, match=r"refused at 'pending_turns', nothing was changed"):
            target.load_state_dict(state)
        assert (target.engine.model.tag.item(), target.policy_version, target.turns_run) == before
    finally:
        source.shutdown()
        target.shutdown()


def nan_weight(state) -> None:
    state["policy_state_dict"]["norm.weight"][3] = float("nan")


def test_a_checkpoint_holding_nan_weights_is_refused_with_nothing_changed(tmp_path: Path) -> None:
    saved_run(tmp_path / "ckpt")
    rewrite_state(tmp_path / "ckpt", "collectors.0", nan_weight)
    targets = [build_with_weights(), build_with_weights()]
    before = [snapshot(c) for c in targets]
    with pytest.raises(ValueError, match=r"collector 0's state was refused.*'norm.weight' holds NaN or infinite values"):
        load_checkpoint(tmp_path / "ckpt", targets)
    assert all(same_snapshot(snapshot(c), b) for c, b in zip(targets, before, strict=True))
    load_checkpoint(tmp_path / "ckpt", targets, allow_non_finite=True)  # restored on purpose
    assert torch.isnan(targets[0].get_policy_model().norm.weight[3]) and targets[0].policy_version == 1


def link_to_another_run(folder: Path, elsewhere: Path) -> None:
    """Collector 0's state file becomes a link to another run's (a valid state, outside the folder)."""
    other = json.loads((elsewhere / "manifest.json").read_text())["collectors"][1]["file"]
    name = json.loads((folder / "manifest.json").read_text())["collectors"][0]["file"]
    (folder / name).unlink()
    (folder / name).symlink_to(elsewhere / other)


def link_inside_the_folder(folder: Path, elsewhere: Path) -> None:
    """Collector 0's state file becomes a link to a copy of another run's state in the same folder."""
    other = json.loads((elsewhere / "manifest.json").read_text())["collectors"][1]["file"]
    shutil.copy(elsewhere / other, folder / "copied.safetensors")
    name = json.loads((folder / "manifest.json").read_text())["collectors"][0]["file"]
    (folder / name).unlink()
    (folder / name).symlink_to("copied.safetensors")


def link_the_manifest(folder: Path, elsewhere: Path) -> None:
    """The manifest becomes a link to another run's manifest (naming that run's files, copied here)."""
    for path in elsewhere.glob("*.safetensors"):
        shutil.copy(path, folder / path.name)
    (folder / "manifest.json").unlink()
    (folder / "manifest.json").symlink_to(elsewhere / "manifest.json")


@pytest.mark.parametrize("plant", [link_to_another_run, link_inside_the_folder, link_the_manifest])
def test_a_state_file_that_is_a_symlink_is_refused_with_nothing_changed(tmp_path: Path, plant) -> None:
    saved_run(tmp_path / "ckpt")
    others = saved_run(tmp_path / "other")
    others[1].next()
    save_checkpoint(tmp_path / "other", others)  # another run, further along: what a link would smuggle in
    plant(tmp_path / "ckpt", tmp_path / "other")
    targets = [build_with_weights(), build_with_weights()]
    before = [snapshot(c) for c in targets]
    with pytest.raises(ValueError, match=r"is a symbolic link: a checkpoint's files are regular files in its own folder"):
        load_checkpoint(tmp_path / "ckpt", targets)
    assert all(same_snapshot(snapshot(c), b) for c, b in zip(targets, before, strict=True))
    assert os.path.islink(next(p for p in (tmp_path / "ckpt").iterdir() if p.is_symlink()))  # nothing was "repaired"


def test_a_second_save_into_a_folder_being_saved_is_refused_and_the_first_stays_whole(tmp_path: Path, monkeypatch) -> None:
    import threading

    from tests.factories import run_in_thread

    first, second = build(), build()
    first.next()
    expected = ids(build_restored_after(first, tmp_path / "reference"))
    real_save, writing, proceed = codec.save, threading.Event(), threading.Event()

    def slow_save(path, state):
        real_save(path, state)
        writing.set()
        assert proceed.wait(30), "the test never let the first save go on"

    monkeypatch.setattr(codec, "save", slow_save)
    join = run_in_thread(lambda: save_checkpoint(tmp_path, [first]), timeout_s=60)
    assert writing.wait(30), "the first save never wrote its file"
    monkeypatch.setattr(codec, "save", real_save)
    try:
        with pytest.raises(RuntimeError, match=r"another save_checkpoint is writing into .* save into another folder"):
            save_checkpoint(tmp_path, [second])
    finally:
        proceed.set()
        join()
    restored = build()
    load_checkpoint(tmp_path, [restored])  # the first save, whole: the refused one deleted nothing
    assert ids(restored.next()) == expected
    save_checkpoint(tmp_path, [second])  # once the first returned, the folder takes saves again


def build_restored_after(collector: LLMCollector, folder: Path):
    """The batch a collector restored from a save of ``collector`` now yields next."""
    save_checkpoint(folder, [collector])
    restored = build()
    load_checkpoint(folder, [restored])
    return restored.next()


def test_checkpoint_files_are_readable_by_their_owner_only(tmp_path: Path) -> None:
    collector = build()
    collector.next()
    buffer = ReplayBuffer(capacity=8)
    save_checkpoint(tmp_path, [collector], replay_buffer=buffer)
    modes = {p.name: p.stat().st_mode & 0o777 for p in tmp_path.iterdir()}
    assert modes and set(modes.values()) == {0o600}, modes


def test_a_load_removes_the_files_of_a_save_killed_before_it_removed_the_old_ones(tmp_path: Path, monkeypatch) -> None:
    """Found by the chaos harness (benchmarks/chaos.py --quick, a driver SIGKILLed during its last save): a
    save killed after its manifest's replace, before it removed the earlier save's files, left them; a
    run resumed at its last batch saves no more, so nothing removed them. The load does now."""
    from lmcollect import checkpoint

    collector, buffer = build(), ReplayBuffer(capacity=8)
    collector.next()
    save_checkpoint(tmp_path, [collector], replay_buffer=buffer)
    with monkeypatch.context() as patch:
        patch.setattr(checkpoint, "_remove_other_saves", lambda folder, keep: None)  # killed before the removal
        save_checkpoint(tmp_path, [collector], replay_buffer=buffer)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    named = {e["file"] for e in manifest["collectors"]} | {manifest["replay_buffer"]["file"]}
    assert len(list(tmp_path.glob("*.safetensors"))) == 4  # the earlier save's two files are still there
    load_checkpoint(tmp_path, [build()], replay_buffer=ReplayBuffer(capacity=8))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(named | {"manifest.json", ".save.lock"})
