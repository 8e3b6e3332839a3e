"""What only the Ray layer does: actor options, overlap, shared buffers, actor death and restart."""
from __future__ import annotations

import functools
import os
import signal
import time

import pytest
import ray
import torch

from lmcollect.ray import RayReplayBuffer
from lmcollect.ray.collector import CollectorActorError, RayLLMCollector
from lmcollect.ray.group import RayCollectorGroup
from lmcollect.data import keys
from lmcollect.data.turns import flatten_turns

from tests.factories import make_guesser, make_guessing_env, make_uneven_guessing_env

pytestmark = pytest.mark.integration

make_env, make_policy = make_guessing_env, make_guesser


def collector(**kwargs) -> RayLLMCollector:
    kwargs.setdefault("dialog_turns_per_batch", 4)
    kwargs.setdefault("num_cpus", 0.25)
    return RayLLMCollector(make_env, policy_factory=make_policy, **kwargs)


def test_remote_config_none_and_not_mutated(ray_cluster) -> None:
    with collector(remote_config=None, num_cpus=None) as c:
        assert c.next().batch_size == torch.Size([2, 2])
    config = {"num_cpus": 0.5, "max_concurrency": 2}
    with collector(remote_config=config, num_cpus=0.2) as c:
        assert c._options["num_cpus"] == 0.2  # num_cpus overrides remote_config
        c.next()
    assert config == {"num_cpus": 0.5, "max_concurrency": 2}


def test_as_remote_works_on_its_own(ray_cluster) -> None:
    actor_cls = RayLLMCollector.as_remote({"num_cpus": 0.25})
    actor = actor_cls.remote(make_env, policy_factory=make_policy, dialog_turns_per_batch=2)
    batch, finished = ray.get(actor.collect_next.remote())
    assert batch.batch_size == torch.Size([2, 1]) and not finished
    ray.kill(actor)


def _turns_run_within(c: RayLLMCollector, target: int, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while c.turns_run < target and time.monotonic() < deadline:
        time.sleep(0.05)
    return c.turns_run


def test_sync_iter_false_collects_while_caller_works(ray_cluster) -> None:
    with collector(sync_iter=False, total_dialog_turns=16) as c:
        batches = []
        for batch in c:
            batches.append(batch)
            if len(batches) == 1:
                # while the caller holds batch 1 (and asks for nothing), the actor collects batch 2
                assert _turns_run_within(c, 8, timeout_s=30) == 8, "the next batch was not collected in the background"
                time.sleep(0.5)
                assert c.turns_run == 8, "the actor ran past the one prefetched batch"
        assert len(batches) == 4
        ids = [(int(t[keys.TRAJ_IDS]), int(t[keys.STEP_COUNT])) for b in batches for t in flatten_turns(b)]
        assert len(ids) == len(set(ids)) == 16


def test_sync_iter_true_waits_for_the_caller(ray_cluster) -> None:
    with collector(sync_iter=True, total_dialog_turns=16) as c:
        seen = []
        for _ in c:
            time.sleep(1.0)  # the actor would finish another batch in this time, if it ran ahead
            seen.append(c.turns_run)
        assert seen == [4, 8, 12, 16], "with sync_iter=True the actor collects only when asked"


def test_two_collectors_fill_one_ray_buffer(ray_cluster) -> None:
    buffer = RayReplayBuffer(capacity=10_000)
    with RayCollectorGroup(
        2, env=make_env, policy_factory=make_policy, dialog_turns_per_batch=4, replay_buffer=buffer,
        total_dialog_turns=24, num_cpus=0.25,
    ) as group:
        group.start()
        deadline = time.monotonic() + 60
        while len(buffer) < 48 and time.monotonic() < deadline:
            time.sleep(0.1)
    assert len(buffer) == 48 == buffer.write_count
    sample = buffer.sample(48, replace=False)
    ids = {(int(t[keys.TRAJ_IDS]), int(t[keys.STEP_COUNT])) for t in flatten_turns(sample)}
    assert len(ids) == 48, "a turn was duplicated or lost"
    assert {i >> 32 for i, _ in ids} == {0, 1}  # both collectors wrote
    buffer.shutdown()


def test_the_policy_is_built_in_the_actor_and_ray_buffer_samples_return_versions(ray_cluster) -> None:
    buffer = RayReplayBuffer(capacity=100)
    with collector(replay_buffer=buffer, track_policy_version=True) as c:
        assert c.getattr_policy("num_calls") == 0
        c.next()
        assert c.getattr_policy("num_calls") == 2  # the actor's own policy did the work
        c.increment_version()
        c.next()
    assert set(buffer.sample(50)[keys.POLICY_VERSION].tolist()) == {0, 1}
    assert set(buffer.sample(20, min_policy_version=1)[keys.POLICY_VERSION].tolist()) == {1}
    buffer.shutdown()


def _actor_pid(c: RayLLMCollector) -> int:
    return c.process_info()["pid"]


def test_dead_actor_raises_quickly_and_buffer_keeps_data(ray_cluster) -> None:
    buffer = RayReplayBuffer(capacity=1000)
    c = collector(replay_buffer=buffer)
    c.next()
    os.kill(_actor_pid(c), signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(CollectorActorError, match=r"RayLLMCollector-\w+'s actor died during collect_next"):
        c.next()
    assert time.monotonic() - start < 120, "a dead actor was noticed only at the call timeout"
    assert len(buffer) == 4  # what the dead collector wrote survives
    c.shutdown()
    buffer.shutdown()


def test_max_restarts_brings_the_actor_back(ray_cluster) -> None:
    c = collector(remote_config={"max_restarts": 1, "num_cpus": 0.25})
    c.next()
    os.kill(_actor_pid(c), signal.SIGKILL)
    with pytest.raises(CollectorActorError, match="restarted"):
        c.next()
    assert c.next().batch_size == torch.Size([2, 2])  # collection continues
    c.shutdown()


# ---------------------------------------------------------------------- the turn budget through the actor
MODE_ARGUMENTS = {
    "steps": {},
    "trajectories": {"yield_completed_trajectories": True},
    "last_steps": {"yield_only_last_steps": True},
}


@pytest.mark.parametrize("mode", list(MODE_ARGUMENTS))
def test_a_finite_ray_collector_over_uneven_async_envs_yields_every_promised_turn(ray_cluster, mode: str) -> None:
    envs = [functools.partial(make_uneven_guessing_env, seed) for seed in range(8)]
    with RayLLMCollector(envs, async_envs=True, policy_factory=make_policy, dialog_turns_per_batch=16,
                         total_dialog_turns=64, num_cpus=0.25, **MODE_ARGUMENTS[mode]) as c:
        batches = list(c)
        ids = [(int(t[keys.TRAJ_IDS]), int(t[keys.STEP_COUNT])) for b in batches for t in flatten_turns(b)]
        assert len(ids) == len(set(ids)) == c.turns_yielded
        if mode == "steps":
            assert len(ids) == 64 == c.turns_run == c.turns_counted, "every turn run is yielded, none past the budget"
        elif mode == "trajectories":
            assert 64 <= len(ids) == c.turns_counted < 64 + 16 + 5 * 8
        else:  # a last step counts its trajectory's every turn (torchrl's rule): whole batches until 64 ran
            counted = [sum(int(t[keys.STEP_COUNT]) + 1 for t in flatten_turns(b)) for b in batches]
            assert c.turns_counted == sum(counted) >= 64 > sum(counted[:-1])
            assert c.turns_run == c.turns_counted + c.num_buffered_turns


def test_start_into_a_ray_buffer_writes_every_promised_turn(ray_cluster) -> None:
    buffer = RayReplayBuffer(capacity=1000)
    envs = [functools.partial(make_uneven_guessing_env, seed) for seed in range(4)]
    with RayLLMCollector(envs, async_envs=True, policy_factory=make_policy, dialog_turns_per_batch=8,
                         total_dialog_turns=50, replay_buffer=buffer, num_cpus=0.25) as c:
        c.start()
        deadline = time.monotonic() + 120
        while c.is_running():
            assert time.monotonic() < deadline, "start() did not finish its 50-turn budget within 120 s"
            time.sleep(0.1)
        assert len(buffer) == c.turns_yielded == c.turns_run == 56  # ceil(50 / 8) = 7 batches of 8
        sample = flatten_turns(buffer.sample(56, replace=False))
        assert len({(int(t[keys.TRAJ_IDS]), int(t[keys.STEP_COUNT])) for t in sample}) == 56
    buffer.shutdown()
