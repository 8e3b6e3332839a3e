"""A trainer process whose Ray head dies under it (run by test_fault_ray_head.py in a subprocess).

Run: python -m tests.faults.head_loss_driver CHECKPOINT_DIR (from the repo root)

It starts a Ray cluster of its own, collects three batches with a RayLLMCollector into a
RayReplayBuffer, checkpoints both (``save_checkpoint``), starts background collection, then
SIGKILLs the head's GCS server and raylet and keeps calling the collector and the buffer,
printing one JSON line per call (seconds since the kill, outcome), until Ray ends this process.
"""
from __future__ import annotations

import functools
import json
import os
import signal
import sys
import time

import ray

from lmcollect.ray import RayReplayBuffer
from lmcollect.checkpoint import save_checkpoint
from lmcollect.ray.collector import RayLLMCollector
from tests.faults.fault_factories import GuessingEnv, GuessingPolicy

BATCH = 4
CALL_TIMEOUT_S = 10.0
MAX_WATCH_S = 120.0


def build(buffer: RayReplayBuffer) -> RayLLMCollector:
    """The collector of the run (the test builds the same one to resume from the checkpoint)."""
    collector = RayLLMCollector(
        GuessingEnv, policy_factory=functools.partial(GuessingPolicy, delay_s=0.02), dialog_turns_per_batch=BATCH,
        replay_buffer=buffer, track_policy_version=True, num_cpus=0.25, call_timeout_s=CALL_TIMEOUT_S,
    )
    collector.worker_idx = 0
    return collector


def report(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def kill_head() -> None:
    node = ray._private.worker._global_node  # Ray has no public handle to its own daemons
    for name in ("gcs_server", "raylet"):
        for info in node.all_processes.get(name, []):
            os.kill(info.process.pid, signal.SIGKILL)


def main() -> None:
    checkpoint_dir = sys.argv[1]
    ray.init(address="local", num_cpus=1, include_dashboard=False)  # its own cluster, never a test worker's
    buffer = RayReplayBuffer(capacity=1000)
    collector = build(buffer)
    for _ in range(3):
        collector.next()
    # no background thread yet: a consistent cut (state_dict under pause() would wait for the pause to end)
    save_checkpoint(checkpoint_dir, [collector], replay_buffer=buffer)
    report(event="checkpoint", written=buffer.write_count)
    collector.start()  # collecting in the background when the head dies
    kill_head()
    killed = time.monotonic()
    report(event="killed")
    while time.monotonic() - killed < MAX_WATCH_S:
        for name, call in (("is_running", collector.is_running), ("buffer.write_count", lambda: buffer.write_count)):
            started = time.monotonic()
            try:
                outcome = f"returned {call()!r}"
            except Exception as exc:  # what a caller sees is the point here
                outcome = f"raised {type(exc).__name__}: {str(exc)[:200]}"
            report(event="call", call=name, at_s=round(started - killed, 2),
                   took_s=round(time.monotonic() - started, 2), outcome=outcome)
        time.sleep(0.5)
    report(event="still alive", after_s=MAX_WATCH_S)


if __name__ == "__main__":
    main()
