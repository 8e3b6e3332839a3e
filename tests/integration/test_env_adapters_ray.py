"""Outside environments in a Ray collector: reasoning-gym and skyrl-gym envs named 'ecosystem:name' and a stateful task, built inside the actor."""
from __future__ import annotations

import pytest

from lmcollect.data import keys
from lmcollect.data.turns import flatten_turns
from tests.env_adapters import (
    check_prompts_extend_full_tokens,
    groups_of,
    make_counter,
    make_counting_env,
    make_reasoning_gym_env,
    make_second_time_player,
    make_skyrl_gym_env,
    make_skyrl_gym_player,
)

pytestmark = pytest.mark.integration
pytest.importorskip("reasoning_gym")  # the optional extras; make test installs them
pytest.importorskip("skyrl_gym")


@pytest.mark.parametrize(
    "make_env_, make_policy",
    [
        (make_reasoning_gym_env, make_second_time_player),
        (make_skyrl_gym_env, make_skyrl_gym_player),
        (make_counting_env, make_counter),
    ],
)
def test_a_ray_collector_builds_the_env_in_its_actor_and_keeps_turns_token_exact(ray_cluster, make_env_, make_policy) -> None:
    from lmcollect.ray.collector import RayLLMCollector

    collector = RayLLMCollector(make_env_, policy_factory=make_policy, num_cpus=0.25, dialog_turns_per_batch=16, flatten_data=True)
    try:
        turns = flatten_turns(collector.next())
    finally:
        collector.shutdown()
    assert check_prompts_extend_full_tokens(turns) >= 4
    assert max(float(t[keys.NEXT_REWARD]) for t in turns) == 1.0
    assert max(len({int(t[keys.TRAJ_IDS]) for t in group}) for group in groups_of(turns).values()) == 2
