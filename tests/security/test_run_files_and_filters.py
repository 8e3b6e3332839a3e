"""Neighbours of the agent endpoint (issue 50): group filters, shared-memory files, checkpoints and bench output.

Part of the security suite: each test feeds one bad value or one race and asserts the refusal, or
that nothing is lost, kept by mistake or left behind.
"""
from __future__ import annotations

import math

import pytest
import torch

from lmcollect.collectors.shared.group_filter import NON_FINITE_REWARDS, UNIFORM_REWARDS, drop_uniform_rewards, keep_mean_reward_in


# ---------------------------------------------------------------------- 12: group filters
@pytest.mark.parametrize(
    "rewards",
    [[math.nan, 1.0], [math.nan, math.nan], [math.inf, math.inf], [-math.inf, 0.0]],
    ids=["one_nan", "all_nan", "all_inf", "minus_inf"],
)
def test_the_shipped_group_filters_drop_groups_with_non_finite_rewards(rewards: list[float]) -> None:
    rewards_t = torch.tensor(rewards)
    assert drop_uniform_rewards()(rewards_t) == NON_FINITE_REWARDS
    assert keep_mean_reward_in()(rewards_t) == NON_FINITE_REWARDS
    assert keep_mean_reward_in(0.0, 1.0)(rewards_t) == NON_FINITE_REWARDS
    assert drop_uniform_rewards()(torch.tensor([1.0, 1.0])) == UNIFORM_REWARDS  # finite groups as before
    assert keep_mean_reward_in(0.0, 1.0)(torch.tensor([0.0, 1.0])) is None


def test_a_nan_band_is_refused() -> None:
    with pytest.raises(ValueError, match="must be <= high"):
        keep_mean_reward_in(math.nan, 1.0)


# ---------------------------------------------------------------------- 13: shared-memory pack files
CREATE_AND_WAIT = """
import sys, time
from pathlib import Path
import lmcollect.engines.vllm.shm_payload as shm
shm.SHM_DIR = Path(sys.argv[1])
kept = shm.SharedBufferFile(4096)
print(kept.path, flush=True)
time.sleep(60)
"""


def test_pack_files_of_a_killed_engine_are_removed_and_live_ones_kept(tmp_path, monkeypatch) -> None:
    import signal
    import subprocess
    import sys
    from pathlib import Path

    import lmcollect.engines.vllm.shm_payload as shm

    child = subprocess.Popen([sys.executable, "-c", CREATE_AND_WAIT, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        killed = Path(child.stdout.readline().strip())
        assert killed.exists()
        assert shm.remove_stale_push_files(tmp_path, min_age_s=0) == []  # its creator lives: locked, kept
    finally:
        child.send_signal(signal.SIGKILL)  # as the OOM killer does: no finalizer runs
        child.wait(timeout=30)
        child.stdout.close()
    assert killed.exists()
    monkeypatch.setattr(shm, "SHM_DIR", tmp_path)
    live = shm.SharedBufferFile(4096)  # this process's own file: locked, kept
    assert shm.remove_stale_push_files(tmp_path) == []  # younger than STALE_AFTER_S: never taken
    # a few seconds later (an engine started again after a kill: the chaos harness's restarts), it is
    now = shm.time.time()
    monkeypatch.setattr(shm.time, "time", lambda: now + 3.0)
    assert shm.remove_stale_push_files(tmp_path) == [str(killed)]
    assert not killed.exists() and Path(live.path).exists()
    live.remove()
    assert not Path(live.path).exists()
