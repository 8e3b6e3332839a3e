"""Checkpoints: a save that crashes midway leaves the earlier one whole; a manifest cannot point outside its folder."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmcollect.checkpoint import load_checkpoint, save_checkpoint
from lmcollect.collectors import LLMCollector
from lmcollect.data import codec, keys
from lmcollect.data.turns import flatten_turns
from lmcollect.testing import ScriptedPolicy
from tests.factories import make_guessing_env


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
