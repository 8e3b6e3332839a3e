"""The data contract across processes: versions after restarts, ids and groups in one buffer, timeouts."""
from __future__ import annotations

import functools
import os
import signal
import time
from collections import Counter

import pytest
import ray
import torch
from ray.exceptions import RayTaskError

from lmcollect.ray import RayReplayBuffer
from lmcollect.collectors.collector_worker import CollectorRestartedError
from lmcollect.ray.collector import CollectorActorError, RayLLMCollector
from lmcollect.ray.group import RayCollectorGroup
from lmcollect.data import keys
from lmcollect.data.turns import flatten_turns
from lmcollect.models import load_model_and_tokenizer
from lmcollect.testing import ScriptedPolicy
from lmcollect.ray.updater import RayRemoteWeightUpdater
from lmcollect.weight_sync import PushConfig
from tests.factories import (
    perturbed_model,
    make_arithmetic_env,
    make_greedy_tiny_policy,
    make_grouped_env,
    make_guesser,
    make_guessing_env,
    make_slow_env,
)

pytestmark = pytest.mark.integration

MAX_NEW_TOKENS = 6





def _kill(c: RayLLMCollector) -> None:
    os.kill(c.process_info()["pid"], signal.SIGKILL)


def test_a_restarted_actor_gets_its_weights_version_seed_and_id_range_back(ray_cluster, tiny_model_path) -> None:
    c = RayLLMCollector(
        make_arithmetic_env,
        policy_factory=functools.partial(make_greedy_tiny_policy, str(tiny_model_path), MAX_NEW_TOKENS),
        dialog_turns_per_batch=4,
        track_policy_version=True,
        remote_config={"max_restarts": 1, "num_cpus": 0.25},
    )
    try:
        c.worker_idx = 3
        c.set_seed(11)
        trainer = perturbed_model(tiny_model_path, seed=5)
        updater = RayRemoteWeightUpdater(trainer, [c], config=PushConfig(timeout_s=60))
        for _ in range(3):
            updater.push_weights()
        before = flatten_turns(c.next())
        assert {int(t[keys.POLICY_VERSION]) for t in before} == {3}
        _kill(c)
        with pytest.raises(CollectorActorError, match="restarted .* and restored"):
            c.next()
        after = flatten_turns(c.next())
        assert {int(t[keys.POLICY_VERSION]) for t in after} == {3} and c.policy_version == 3
        ids_before = {int(t[keys.TRAJ_IDS]) for t in before}
        ids_after = {int(t[keys.TRAJ_IDS]) for t in after}
        assert not ids_before & ids_after, "a trajectory id repeated after the restart"
        assert all(i >> 32 == 3 for i in ids_before | ids_after), "ids left worker 3's range"
        # the outputs are those of a fresh model holding the pushed weights
        fresh, tokenizer = load_model_and_tokenizer(tiny_model_path)
        fresh.load_state_dict(trainer.state_dict())
        for turn in after:
            prompt = turn[keys.TOKENS_PROMPT].unsqueeze(0)
            out = fresh.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=MAX_NEW_TOKENS,
                                 do_sample=False, pad_token_id=tokenizer.pad_token_id)
            expected = out[0, prompt.shape[1]:]
            assert torch.equal(turn[keys.TOKENS_RESPONSE], expected[: turn[keys.TOKENS_RESPONSE].numel()])
    finally:
        c.shutdown()


def test_a_restarted_actor_driven_by_hand_refuses_to_collect(ray_cluster) -> None:
    actor = RayLLMCollector.as_remote({"num_cpus": 0.25, "max_restarts": 1}).remote(
        make_guessing_env, policy_factory=make_guesser, dialog_turns_per_batch=2, track_policy_version=True
    )
    try:
        ray.get(actor.collect_next.remote(), timeout=60)
        os.kill(ray.get(actor.process_info.remote(), timeout=30)["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 60
        while True:
            try:
                ray.get(actor.ping.remote(), timeout=5)
                break
            except Exception:
                assert time.monotonic() < deadline, "the actor did not come back"
                time.sleep(0.5)
        with pytest.raises(RayTaskError) as info:
            ray.get(actor.collect_next.remote(), timeout=60)
        assert isinstance(info.value.cause, CollectorRestartedError)
        assert "initial weights" in str(info.value.cause)
        ray.get(actor.restore_after_restart.remote(worker_idx=0, restarts=1, seed=None), timeout=60)
        batch, _ = ray.get(actor.collect_next.remote(), timeout=60)
        assert batch.numel() == 2
    finally:
        ray.kill(actor)


def test_untracked_versions_stay_untracked_through_the_actor(ray_cluster) -> None:
    from tests.factories import SmallModelPolicy, SmallNet

    with RayLLMCollector(make_arithmetic_env, policy_factory=SmallModelPolicy, dialog_turns_per_batch=4, num_cpus=0.25) as c:
        RayRemoteWeightUpdater(SmallNet(), [c]).push_weights()
        c.increment_version()
        assert c.policy_version is None
        assert {int(t[keys.POLICY_VERSION]) for t in flatten_turns(c.next())} == {-1}


def test_two_collectors_with_two_async_envs_write_distinct_complete_groups(ray_cluster) -> None:
    buffer = RayReplayBuffer(capacity=10_000)
    envs = [functools.partial(make_grouped_env, 0), functools.partial(make_grouped_env, 1)]
    with RayCollectorGroup(
        2, env=envs, async_envs=True, policy_factory=functools.partial(ScriptedPolicy, "#### 1"),
        dialog_turns_per_batch=16, replay_buffer=buffer, total_dialog_turns=32, num_cpus=0.25, flatten_data=True,
    ) as group:
        for c in group:
            c.next()
    turns = flatten_turns(buffer.sample(len(buffer), replace=False))
    buffer.shutdown()
    assert Counter(int(t.get(keys.ENV_PROMPT_ID)) for t in turns).most_common(1)[0][1] > 2  # env ids collide
    sizes = Counter(int(t.get(keys.GROUP_ID)) for t in turns)
    prompts: dict[int, set[str]] = {}
    for t in turns:
        prompts.setdefault(int(t.get(keys.GROUP_ID)), set()).add(t.get_non_tensor(keys.TEXT_PROMPT))
    assert set(sizes.values()) == {2} and all(len(p) == 1 for p in prompts.values())
    assert {g >> 32 for g in sizes} == {0, 1}


def test_separately_built_collectors_never_share_ids_in_one_buffer(ray_cluster) -> None:
    buffer = RayReplayBuffer(capacity=1000)
    collectors = [
        RayLLMCollector(make_grouped_env, policy_factory=functools.partial(ScriptedPolicy, "#### 1"),
                        dialog_turns_per_batch=4, replay_buffer=buffer, num_cpus=0.25)
        for _ in range(2)
    ]
    try:
        for c in collectors:
            c.next()
        turns = flatten_turns(buffer.sample(8, replace=False))
    finally:
        for c in collectors:
            c.shutdown()
        buffer.shutdown()
    assert len({int(t.get(keys.TRAJ_IDS)) for t in turns}) == 8
    assert len({int(t.get(keys.GROUP_ID)) for t in turns}) == 4


def test_a_stuck_actor_raises_instead_of_blocking(ray_cluster) -> None:
    c = RayLLMCollector(make_slow_env, policy_factory=functools.partial(ScriptedPolicy, "1"), dialog_turns_per_batch=2,
                        num_cpus=0.25, collect_timeout_s=2)
    try:
        started = time.monotonic()
        with pytest.raises(CollectorActorError, match=r"did not answer collect_next\(\) within 2 s"):
            c.next()
        assert time.monotonic() - started < 90, "collect_timeout_s=2 did not bound the call"
        with pytest.raises(ValueError, match="call_timeout_s"):
            RayLLMCollector(make_slow_env, policy_factory=ScriptedPolicy, dialog_turns_per_batch=2, call_timeout_s=0)
    finally:
        c.shutdown(timeout=1)
