"""RayContinuousLLMCollector: the continuous collector in an actor, iterated and writing into a RayReplayBuffer."""
from __future__ import annotations

import time
from collections import defaultdict

import pytest
import torch

from lmcollect.ray import RayReplayBuffer
from lmcollect.ray.continuous import RayContinuousLLMCollector
from lmcollect.data import keys
from lmcollect.data.turns import flatten_turns
from lmcollect.testing.scripted_engine import ByteTokenizer
from lmcollect.policies import SamplingConfig
from lmcollect.collectors import DynamicSampling
from tests.factories import EveryOtherGroup, make_group_tool_env, make_tool_engine, make_tool_env

pytestmark = pytest.mark.integration


make_env, make_engine = make_tool_env, make_tool_engine


def collector(**kwargs) -> RayContinuousLLMCollector:
    return RayContinuousLLMCollector(
        make_env, engine_factory=make_engine, tokenizer=ByteTokenizer(), sampling=SamplingConfig(max_new_tokens=64),
        dialog_turns_per_batch=4, max_dialogs_in_flight=4, track_policy_version=True, num_cpus=0.25, **kwargs,
    )


def test_iterating_with_pushes_every_batch_keeps_the_lag_bound(ray_cluster) -> None:
    with collector(total_dialog_turns=24, max_policy_lag=1) as c:
        c.set_seed(0)
        turns = []
        for batch in c:
            now = c.get_policy_version()
            got = flatten_turns(batch)
            assert all(now - int(t[keys.POLICY_VERSION]) <= 1 for t in got)
            turns += got
            c.update_policy_weights_({"tag": torch.tensor([float(now + 1)])})
    assert len(turns) == 24
    for t in turns:
        versions = t.get(keys.TOKEN_VERSIONS)
        assert int(versions.min()) >= int(t[keys.POLICY_VERSION])


def test_start_writes_every_finished_turn_into_a_ray_replay_buffer(ray_cluster) -> None:
    buffer = RayReplayBuffer(capacity=10_000)
    c = collector(replay_buffer=buffer)
    c.set_seed(0)
    c.start()
    deadline = time.monotonic() + 120
    while len(buffer) < 12:
        assert time.monotonic() < deadline, "no turns reached the buffer"
        time.sleep(0.05)
    c.update_policy_weights_({"tag": torch.tensor([1.0])})
    with c.pause():
        run = c.turns_run
        written = len(buffer)
        assert written + c.num_buffered_turns == run
    c.shutdown()  # finished turns no batch took go to the buffer too
    turns = flatten_turns(buffer.sample(len(buffer), replace=False))
    assert len(turns) >= run
    steps = defaultdict(set)
    for t in turns:
        steps[int(t[keys.TRAJ_IDS])].add(int(t[keys.STEP_COUNT]))
    assert sum(len(s) for s in steps.values()) == len(turns)  # no (trajectory, step) twice
    assert all(s == set(range(len(s))) for s in steps.values())


def test_grpo_groups_reach_the_ray_buffer_whole_under_pushes(ray_cluster) -> None:
    buffer = RayReplayBuffer(capacity=10_000)
    c = RayContinuousLLMCollector(
        make_group_tool_env, engine_factory=make_engine, tokenizer=ByteTokenizer(),
        sampling=SamplingConfig(max_new_tokens=64), dialog_turns_per_batch=4, max_dialogs_in_flight=8,
        track_policy_version=True, max_policy_lag=1, replay_buffer=buffer, num_cpus=0.25,
    )
    c.start()
    deadline = time.monotonic() + 120
    written = 0
    for version in range(1, 4):  # the trainer's pushes, one per batch (one group) written
        while buffer.write_count <= written:
            assert time.monotonic() < deadline, f"only {buffer.write_count} turns reached the buffer"
            time.sleep(0.05)
        written = buffer.write_count
        c.update_policy_weights_({"tag": torch.tensor([float(version)])})
    c.shutdown()
    turns = flatten_turns(buffer.sample(len(buffer), replace=False))
    groups = defaultdict(list)
    for t in turns:
        groups[int(t[keys.GROUP_ID])].append(t)
    assert len(groups) >= 3
    for members in groups.values():
        assert len({int(t[keys.TRAJ_IDS]) for t in members}) == 4  # whole groups only: 4 dialogs each
        assert len({int(t[keys.ENV_PROMPT_ID]) for t in members}) == 1


def test_dynamic_sampling_in_the_actor_refills_and_counts(ray_cluster) -> None:
    with RayContinuousLLMCollector(
        make_group_tool_env, engine_factory=make_engine, tokenizer=ByteTokenizer(),
        sampling=SamplingConfig(max_new_tokens=64), dialog_turns_per_batch=4, max_dialogs_in_flight=8,
        track_policy_version=True, max_policy_lag=1, num_cpus=0.25,
        dynamic_sampling=DynamicSampling(group_filter=EveryOtherGroup(), oversample_groups=1),
    ) as c:
        groups = []
        for _ in range(3):  # multi-turn dialogs: the turn budget would end after a group or two; take 3 batches
            batch = c.next()
            turns = flatten_turns(batch)
            assert len({int(t[keys.GROUP_ID]) for t in turns}) == 1  # one whole kept group per batch
            assert len({int(t[keys.TRAJ_IDS]) for t in turns}) == 4
            assert c.last_batch_counts.groups_kept == 1
            groups.append(int(turns[0][keys.GROUP_ID]))
            c.update_policy_weights_({"tag": torch.tensor([float(c.get_policy_version() + 1)])})
        counts = c.sampling_counts
    assert len(groups) == 3 == counts.groups_kept and counts.batches == 3
    assert counts.groups_dropped["every_other"] >= 2  # each kept group had a dropped one before it
    assert counts.groups_generated == counts.groups_kept + counts.dropped + counts.groups_waiting
