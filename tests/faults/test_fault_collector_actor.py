"""Collector actors SIGKILLed in the middle of a batch, while they collect into a shared RayReplayBuffer.

Two collectors write into one buffer: one without restarts (it stays dead: the next call raises
``CollectorActorError`` naming it, within the call timeout), one with ``max_restarts=1`` (the next
call raises, naming the restart; it is restored and goes on collecting in a fresh id sub-block).
Every turn either had written before the kill stays in the buffer; no (trajectory id, step)
repeats, before or after the restart.
"""
from __future__ import annotations

import functools
import os
import signal
import time

import pytest

from benchmarks.soak import account_turns
from lmcollect.ray import RayReplayBuffer
from lmcollect.ray.collector import CollectorActorError, RayLLMCollector
from lmcollect.collectors.shared.trajectories import ID_BLOCK_BITS, RESTART_BITS
from lmcollect.data import keys
from tests.faults.fault_factories import GuessingEnv, GuessingPolicy

pytestmark = pytest.mark.integration

BATCH = 8  # 4 policy calls of 2 envs
CALL_TIMEOUT_S = 30.0
POLICY_DELAY_S = 0.1  # a batch takes >= 0.4 s: time to kill an actor in the middle of one


def keys_of(turns: list, worker_idx: int) -> set[tuple[int, int]]:
    """(trajectory id, step) of every turn that worker ``worker_idx`` wrote."""
    return {(int(t[keys.TRAJ_IDS]), int(t[keys.STEP_COUNT])) for t in turns if int(t[keys.TRAJ_IDS]) >> ID_BLOCK_BITS == worker_idx}


def buffer_turns(buffer: RayReplayBuffer) -> list:
    """Every turn in the buffer, read atomically (a sample of len(buffer) could miss turns written meanwhile)."""
    return list(buffer.state_dict()["storage"])


def written_keys(buffer: RayReplayBuffer, worker_idx: int) -> set[tuple[int, int]]:
    return keys_of(buffer_turns(buffer), worker_idx)


def settled_keys(buffer: RayReplayBuffer, worker_idx: int) -> set[tuple[int, int]]:
    """What a killed worker wrote, once a write it sent just before dying has landed."""
    previous, current = None, written_keys(buffer, worker_idx)
    while current != previous:
        time.sleep(0.3)
        previous, current = current, written_keys(buffer, worker_idx)
    return current


def kill_mid_batch(collector: RayLLMCollector, timeout_s: float = 30.0) -> int:
    """SIGKILL the actor once it has run part of a batch; returns the turns of that batch it had run."""
    pid = collector.process_info()["pid"]
    deadline = time.monotonic() + timeout_s
    while (in_batch := collector.turns_run % BATCH) == 0:
        assert time.monotonic() < deadline, "the collector never got into a batch"
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    return in_batch


def wait_for(condition, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


@pytest.mark.fault_timeout(180)
def test_collectors_killed_mid_batch_keep_every_written_turn_and_a_restarted_one_goes_on(ray_cluster, fault_table) -> None:
    buffer = RayReplayBuffer(capacity=10_000)
    make = functools.partial(
        RayLLMCollector,
        GuessingEnv,
        policy_factory=functools.partial(GuessingPolicy, delay_s=POLICY_DELAY_S),
        dialog_turns_per_batch=BATCH,
        replay_buffer=buffer,
        call_timeout_s=CALL_TIMEOUT_S,
    )
    mortal = make(remote_config={"num_cpus": 0.25})
    phoenix = make(remote_config={"num_cpus": 0.25, "max_restarts": 1})
    try:
        for worker_idx, collector in enumerate((mortal, phoenix)):
            collector.worker_idx = worker_idx
            collector.start()
        wait_for(lambda: len(written_keys(buffer, 0)) >= 2 * BATCH and len(written_keys(buffer, 1)) >= 2 * BATCH)

        # no restarts: the collector is gone, the buffer keeps what it wrote
        in_batch = kill_mid_batch(mortal)
        started = time.monotonic()
        with pytest.raises(CollectorActorError, match=rf"{mortal!r}'s actor died during is_running"):
            mortal.is_running()
        mortal_error_s = time.monotonic() - started
        assert mortal_error_s < CALL_TIMEOUT_S
        mortal_written = settled_keys(buffer, 0)
        fault_table.add(
            "collector actor SIGKILLed mid-batch (no restarts)",
            f"SIGKILL of the actor's process after {in_batch} of {BATCH} turns of a batch, collecting into a RayReplayBuffer",
            f"CollectorActorError naming {mortal!r} on the next call; the buffer keeps its {len(mortal_written)} "
            f"written turns (the {in_batch} unwritten turns of the batch died with the process)",
            mortal_error_s,
            0,
        )

        # max_restarts=1: restored (worker index, seed, weights + version) and collecting again
        written_earlier = written_keys(buffer, 1)
        in_batch = kill_mid_batch(phoenix)
        before = settled_keys(buffer, 1)  # the dead process writes no more, the restarted one not yet
        started = time.monotonic()
        with pytest.raises(CollectorActorError, match=rf"{phoenix!r}'s actor died during is_running\(\) and was restarted"):
            phoenix.is_running()
        phoenix_error_s = time.monotonic() - started
        wait_for(lambda: len(written_keys(buffer, 1)) >= len(before) + 2 * BATCH)
        assert phoenix.is_running()
        after = written_keys(buffer, 1)
        turns = buffer_turns(buffer)
    finally:
        mortal.shutdown(timeout=5)
        phoenix.shutdown(timeout=5)
        buffer.shutdown()

    assert keys_of(turns, 0) == mortal_written, "turns of the dead collector changed after its death"
    assert written_earlier <= before
    lost = len(before - after)
    assert lost == 0, "turns written before the kill are gone"
    new_ids = {traj for traj, _ in after - before}
    assert all(traj >> RESTART_BITS & 63 == 1 for traj in new_ids), "the restarted actor left its fresh id sub-block"
    assert not new_ids & {traj for traj, _ in before}, "a trajectory id repeated after the restart"
    accounting = account_turns(turns)
    assert accounting["duplicated"] == 0 and accounting["lost"] == 0, accounting
    fault_table.add(
        "collector actor SIGKILLed mid-batch (max_restarts=1)",
        f"SIGKILL after {in_batch} of {BATCH} turns of a batch",
        "CollectorActorError naming the restart on the next call; restored and collecting again, "
        f"{len(after - before)} new turns in a fresh id sub-block, no (trajectory id, step) repeated",
        phoenix_error_s,
        lost,
    )

