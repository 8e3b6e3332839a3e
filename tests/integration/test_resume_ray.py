"""Exact resume through RayLLMCollector and RayReplayBuffer: checkpoint, tear down, restore, continue."""
from __future__ import annotations

from pathlib import Path

import pytest

from lmcollect.ray import RayReplayBuffer
from lmcollect.checkpoint import load_checkpoint, save_checkpoint
from lmcollect.ray.collector import RayLLMCollector
from tests.factories import make_guesser, make_guessing_env
from tests.unit.test_resume import assert_same

pytestmark = pytest.mark.integration


def _setup() -> tuple[RayLLMCollector, RayReplayBuffer]:
    buffer = RayReplayBuffer(capacity=200, seed=0)
    collector = RayLLMCollector(
        make_guessing_env, policy_factory=make_guesser, dialog_turns_per_batch=3, yield_completed_trajectories=True,
        replay_buffer=buffer, track_policy_version=True, num_cpus=0.25,
    )
    collector.worker_idx = 0
    return collector, buffer


def _run(collector: RayLLMCollector, num_batches: int) -> None:
    for _ in range(num_batches):
        assert collector.next() is None  # the batch went into the buffer


def test_ray_collector_and_buffer_resume_exactly(ray_cluster, tmp_path: Path) -> None:
    collector, buffer = _setup()
    try:
        _run(collector, 5)
        expected = buffer.state_dict()
    finally:
        collector.shutdown()
        buffer.shutdown()
    collector, buffer = _setup()
    try:
        _run(collector, 2)
        save_checkpoint(tmp_path / "ckpt", [collector], replay_buffer=buffer)
    finally:
        collector.shutdown()  # the actors are gone: only the folder remains
        buffer.shutdown()
    collector, buffer = _setup()
    try:
        load_checkpoint(tmp_path / "ckpt", [collector], replay_buffer=buffer)
        _run(collector, 3)
        resumed = buffer.state_dict()
    finally:
        collector.shutdown()
        buffer.shutdown()
    assert_same(expected["storage"], resumed["storage"])
    assert expected["write_count"] == resumed["write_count"]
