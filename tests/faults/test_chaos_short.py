"""The chaos harness's short form (``benchmarks/chaos.py --quick``): >= 20 SIGKILLs at seeded random moments,
each run resumed from its last checkpoint, and the interrupted runs yield what the uninterrupted one does.

Also the harness's own checks, fed runs that went wrong: a checker that cannot fail would pass anything.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.chaos import (
    ChaosConfig,
    format_table,
    kept_batches,
    plan_episodes,
    quick_config,
    run_chaos,
    stray_checkpoint_files,
    whole_group_problems,
)


@pytest.mark.fault_timeout(150)
def test_twenty_kills_lose_nothing_repeat_nothing_and_leave_nothing(tmp_path: Path, fault_table) -> None:
    summary = run_chaos(quick_config(seed=0), root=tmp_path)
    table = format_table(summary)
    print(table)  # shown with -s or on failure
    assert summary["kills"] >= 20, table
    assert summary["problems"] == [], table
    assert (summary["lost"], summary["duplicated"], summary["token_diffs"]) == (0, 0, 0), table
    assert summary["weight_mismatches"] == 0 and summary["leftovers"] == [], table
    assert {"driver", "save:buffer", "save:collector", "push:mid"} <= set(summary["kinds"]), table
    assert summary["scenarios"].get("lockstep-ds", 0) >= 1, table  # dynamic sampling: kept groups, counts
    for kind, row in summary["kinds"].items():
        fault_table.add(
            f"chaos: SIGKILL ({kind}), resumed from the last checkpoint",
            f"{row['kills']} kills at seeded random moments (benchmarks/chaos.py --quick)",
            "the resumed runs yield the uninterrupted run's batches; no leftovers",
            row["recovery_max_s"],
            0,
        )


def _event(kind: str, batch: int, **extra) -> dict:
    return {"event": kind, "batch": batch, **extra}


def test_kept_batches_are_each_runs_batches_up_to_where_the_next_resumed() -> None:
    events = [_event("start", 0), _event("batch", 0), _event("batch", 1), _event("batch", 2)]
    events += [_event("start", 2), _event("batch", 2), _event("batch", 3)]
    kept, problems = kept_batches(events)
    assert [b["batch"] for b in kept] == [0, 1, 2, 3] and problems == []
    resumed_too_late = [_event("start", 0), _event("batch", 0), _event("start", 2), _event("batch", 2)]
    assert "not 0..1 once each" in kept_batches(resumed_too_late)[1][0]  # batch 1 lost


def test_a_split_group_and_a_dialog_missing_a_step_are_reported() -> None:
    def turn(group: int, traj: int, step: int, done: bool, prompt: int = 0) -> dict:
        return {"group": group, "traj": traj, "step": step, "done": done, "prompt": prompt}

    whole = [turn(0, 1, 0, False), turn(0, 1, 1, True), turn(0, 2, 0, True)]
    assert whole_group_problems(whole) == []
    assert "has 1 dialogs" in whole_group_problems(whole[:2])[0]
    assert "split" in whole_group_problems([whole[1], whole[2]])[0]


def test_stray_checkpoint_files_are_the_ones_the_manifest_does_not_name(tmp_path: Path) -> None:
    manifest = {"collectors": [{"file": "collector-0.a.safetensors"}], "replay_buffer": None}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    for name in ["collector-0.a.safetensors", ".save.lock", "collector-0.b.safetensors.tmp"]:
        (tmp_path / name).write_text("")
    assert stray_checkpoint_files(tmp_path) == ["collector-0.b.safetensors.tmp"]


def test_the_plan_is_a_function_of_the_seed_and_bad_settings_name_the_knob() -> None:
    def first(seed: int) -> list[dict]:
        episodes = plan_episodes(quick_config(seed))
        return [next(episodes) for _ in range(3)]

    assert first(3) == first(3) and first(3) != first(4)
    with pytest.raises(ValueError, match="num_batches=3"):
        ChaosConfig(num_batches=3, ckpt_every=2)
    with pytest.raises(ValueError, match="unknown scenarios"):
        ChaosConfig(scenarios=("nccl",))
