"""Incremental replay-buffer checkpoints (issue 53): a save writes only the turns added since the last one."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict, lazy_stack

from lmcollect import checkpoint
from lmcollect.buffers import ReplayBuffer
from lmcollect.checkpoint import load_checkpoint, save_checkpoint
from lmcollect.data import codec, keys


def turn(i: int) -> TensorDict:
    return TensorDict(
        {"i": torch.tensor(i), keys.POLICY_VERSION: torch.tensor(0), "tokens": torch.arange(i % 5 + 1)}, batch_size=[]
    )


def add(buffer: ReplayBuffer, start: int, count: int) -> int:
    buffer.extend(lazy_stack([turn(i) for i in range(start, start + count)]))
    buffer.sample(2)  # moves the sampler's RNG: it must be saved too
    return start + count


def contents(buffer: ReplayBuffer) -> tuple:
    state = buffer.state_dict()
    turns = [(int(t["i"]), t["tokens"].tolist()) for t in state["storage"]]
    return turns, state["cursor"], state["write_count"], state["generator"].tolist()


def manifest(folder: Path) -> dict:
    return json.loads((folder / "manifest.json").read_text())


def restored(folder: Path, capacity: int) -> ReplayBuffer:
    buffer = ReplayBuffer(capacity=capacity, seed=123)
    load_checkpoint(folder, [], replay_buffer=buffer)
    return buffer


@pytest.mark.parametrize("adds", [(3, 2, 4), (6, 5, 7), (9, 25, 3)], ids=["filling", "wrapping", "overrun"])
def test_each_of_three_incremental_saves_loads_into_the_buffer_as_it_was(tmp_path: Path, adds) -> None:
    buffer, folder, start, expected = ReplayBuffer(capacity=10, seed=0), tmp_path / "ckpt", 0, []
    for i, count in enumerate(adds):
        start = add(buffer, start, count)
        save_checkpoint(folder, [], replay_buffer=buffer)
        shutil.copytree(folder, tmp_path / f"copy-{i}")
        expected.append(contents(buffer))
    for i, want in enumerate(expected):
        assert contents(restored(tmp_path / f"copy-{i}", 10)) == want, f"save {i} did not load back as saved"
    assert contents(restored(folder, 10)) == expected[-1]


def test_a_save_writes_only_the_new_turns_and_the_folder_stays_bounded(tmp_path: Path) -> None:
    buffer, start = ReplayBuffer(capacity=40, seed=0), 0
    start = add(buffer, start, 30)
    save_checkpoint(tmp_path, [], replay_buffer=buffer)
    start = add(buffer, start, 4)
    save_checkpoint(tmp_path, [], replay_buffer=buffer)
    segments = manifest(tmp_path)["replay_buffer"]["segments"]
    assert [s["count"] for s in segments] == [30, 4]
    assert len(codec.load(tmp_path / segments[-1]["file"])["turns"]) == 4
    for _ in range(60):  # wraps the ring many times: dead segments are pruned, the rest compacted
        start = add(buffer, start, 7)
        save_checkpoint(tmp_path, [], replay_buffer=buffer)
        held = sum(s["count"] for s in manifest(tmp_path)["replay_buffer"]["segments"])
        assert held <= 2 * len(buffer), f"the segments hold {held} turns for a buffer of {len(buffer)}"
        on_disk = {p.name for p in tmp_path.glob("*.safetensors")}
        named = {s["file"] for s in manifest(tmp_path)["replay_buffer"]["segments"]}
        assert on_disk == named | {manifest(tmp_path)["replay_buffer"]["file"]}
    assert contents(restored(tmp_path, 40)) == contents(buffer)


def test_a_save_killed_before_its_manifest_leaves_the_previous_checkpoint_loading_as_it_was(
    tmp_path: Path, monkeypatch
) -> None:
    buffer, start = ReplayBuffer(capacity=10, seed=0), 0
    start = add(buffer, start, 8)
    save_checkpoint(tmp_path, [], replay_buffer=buffer)
    saved = contents(buffer)
    start = add(buffer, start, 5)
    real_replace = os.replace

    def killed_before_the_manifest_replace(src, dst):
        if Path(src).name.startswith("manifest.json."):
            raise OSError("killed")
        real_replace(src, dst)

    with monkeypatch.context() as patch:
        patch.setattr(checkpoint.os, "replace", killed_before_the_manifest_replace)
        with pytest.raises(OSError, match="killed"):
            save_checkpoint(tmp_path, [], replay_buffer=buffer)
    assert contents(restored(tmp_path, 10)) == saved
    save_checkpoint(tmp_path, [], replay_buffer=buffer)  # since the last save whose manifest is in place
    assert contents(restored(tmp_path, 10)) == contents(buffer)
    assert not list(tmp_path.glob("*.tmp"))


def test_a_buffer_emptied_reloaded_or_copied_saves_whole(tmp_path: Path) -> None:
    buffer, start = ReplayBuffer(capacity=10, seed=0), 0
    start = add(buffer, start, 6)
    save_checkpoint(tmp_path, [], replay_buffer=buffer)
    copy = pickle.loads(pickle.dumps(buffer))  # same contents, but its writes no longer follow buffer's
    add(copy, 100, 2)
    save_checkpoint(tmp_path, [], replay_buffer=copy)
    assert [s["count"] for s in manifest(tmp_path)["replay_buffer"]["segments"]] == [8]
    assert contents(restored(tmp_path, 10)) == contents(copy)
    buffer.empty()
    add(buffer, 200, 3)
    save_checkpoint(tmp_path, [], replay_buffer=buffer)
    assert contents(restored(tmp_path, 10)) == contents(buffer)
    buffer.load_state_dict(copy.state_dict())
    save_checkpoint(tmp_path, [], replay_buffer=buffer)
    assert [s["count"] for s in manifest(tmp_path)["replay_buffer"]["segments"]] == [8]
    assert contents(restored(tmp_path, 10)) == contents(copy)


def test_a_checkpoint_written_before_segments_still_loads(tmp_path: Path) -> None:
    """Format 1: the manifest's replay_buffer entry names one file holding the whole state_dict."""
    buffer = ReplayBuffer(capacity=10, seed=0)
    add(buffer, 0, 13)
    codec.save(tmp_path / "replay_buffer.abc.safetensors", buffer.state_dict())
    entry = {"file": "replay_buffer.abc.safetensors", "capacity": 10, "size": 10}
    old = {"format": 1, "save_id": "abc", "saved_at": 0.0, "collectors": [], "replay_buffer": entry}
    (tmp_path / "manifest.json").write_text(json.dumps(old))
    assert contents(restored(tmp_path, 10)) == contents(buffer)
    add(buffer, 13, 2)
    save_checkpoint(tmp_path, [], replay_buffer=buffer)  # over an old-format one: a whole save, old file removed
    assert not (tmp_path / "replay_buffer.abc.safetensors").exists()
    assert contents(restored(tmp_path, 10)) == contents(buffer)


def test_a_segment_naming_a_slot_outside_the_buffer_is_refused_with_nothing_loaded(tmp_path: Path) -> None:
    buffer = ReplayBuffer(capacity=10, seed=0)
    add(buffer, 0, 4)
    save_checkpoint(tmp_path, [], replay_buffer=buffer)
    (segment,) = manifest(tmp_path)["replay_buffer"]["segments"]
    state = codec.load(tmp_path / segment["file"])
    state["slots"][0] = 7
    codec.save(tmp_path / segment["file"], state)
    target = ReplayBuffer(capacity=10, seed=1)
    with pytest.raises(ValueError, match="slot 7 is outside"):
        load_checkpoint(tmp_path, [], replay_buffer=target)
    assert len(target) == 0
