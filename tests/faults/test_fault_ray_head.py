"""The Ray head dies under a running collector: a bounded end, and a resume from the last checkpoint.

Ray restarts a head only with GCS fault tolerance (an external Redis), which a one-machine
cluster does not have. Without it, actor calls keep working for a while (they go straight to
the actors), then Ray ends the driver process once it has failed to reach the GCS for
``gcs_rpc_server_reconnect_timeout_s`` (60 s by default; 3 s here). Everything in the cluster,
the replay buffer included, goes with it: what survives is the last ``save_checkpoint``, from
which a new driver on a new head resumes (``load_checkpoint``) without repeating an id; turns
written after it are lost with the cluster.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.soak import account_turns
from lmcollect.ray import RayReplayBuffer
from lmcollect.checkpoint import load_checkpoint
from tests.faults.head_loss_driver import BATCH, build

pytestmark = pytest.mark.integration

REPO_ROOT = Path(__file__).resolve().parents[2]
RECONNECT_TIMEOUT_S = 3
# a call may wait out call_timeout_s (10 s), never much longer; the slack is for a loaded 2-core machine
LONGEST_CALL_S = 30.0


@pytest.mark.fault_timeout(180)
def test_head_loss_ends_the_driver_within_the_reconnect_timeout_and_the_checkpoint_resumes(
    ray_cluster, tmp_path: Path, fault_table
) -> None:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own cluster, not ours
    env.update(PYTHONPATH=str(REPO_ROOT), RAY_gcs_rpc_server_reconnect_timeout_s=str(RECONNECT_TIMEOUT_S))
    try:
        driver = subprocess.run(
            [sys.executable, "-m", "tests.faults.head_loss_driver", str(tmp_path / "ckpt")],
            cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=150,
        )
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"the head-loss driver ran past 150 s; it printed:\n{exc.stdout}\n{exc.stderr}") from None
    events = [json.loads(line) for line in driver.stdout.splitlines() if line.startswith("{")]
    kinds = [e["event"] for e in events]
    assert "killed" in kinds and "still alive" not in kinds, driver.stdout + driver.stderr[-3000:]
    assert driver.returncode != 0 and "Failed to connect to GCS" in driver.stderr, driver.stderr[-3000:]
    calls = [e for e in events if e["event"] == "call"]
    assert all(c["took_s"] < LONGEST_CALL_S for c in calls), calls
    last_call_s = max((c["at_s"] + c["took_s"] for c in calls), default=0.0)
    assert last_call_s < RECONNECT_TIMEOUT_S + LONGEST_CALL_S, "the driver outlived the reconnect timeout by far"
    written = next(e["written"] for e in events if e["event"] == "checkpoint")

    # a new driver on a new head (this test's cluster) resumes from the checkpoint
    buffer = RayReplayBuffer(capacity=1000)
    collector = build(buffer)
    try:
        load_checkpoint(tmp_path / "ckpt", [collector], replay_buffer=buffer)
        assert buffer.write_count == len(buffer) == written
        collector.next()
        collector.next()
        turns = list(buffer.state_dict()["storage"])
    finally:
        collector.shutdown()
        buffer.shutdown()
    accounting = account_turns(turns)
    assert accounting["turns"] == written + 2 * BATCH
    assert accounting["duplicated"] == accounting["lost"] == 0, accounting
    outcomes = sorted({c["outcome"].split(":")[0] for c in calls if c["call"] == "is_running"})
    counts = [int(c["outcome"].split()[-1]) for c in calls if c["call"] == "buffer.write_count" and c["outcome"].startswith("returned")]
    written_after = max(counts, default=written) - written  # lost with the cluster: after the last checkpoint
    fault_table.add(
        "Ray head (GCS + raylet) killed under a running collector",
        "SIGKILL of the subprocess cluster's gcs_server and raylet while its driver collects",
        f"calls go on (is_running {', '.join(outcomes)}) until Ray ends the driver (exit {driver.returncode}, 'Failed to "
        f"connect to GCS within {RECONNECT_TIMEOUT_S} seconds'); the buffer goes with the cluster; a new driver resumes "
        f"from the last checkpoint ({written} turns, all back) and collects on without repeating an id; the "
        f"{written_after} turns written after that checkpoint went with the cluster",
        last_call_s,
        f"{written + 2 * BATCH - accounting['turns']} checkpointed; {written_after} written after the checkpoint",
    )
