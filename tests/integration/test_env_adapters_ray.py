"""Outside environments in the Ray collectors (RayLLMCollector, RayContinuousLLMCollector) with GRPO groups: reasoning-gym and skyrl-gym envs named 'ecosystem:name' and a stateful task, built inside the actor."""
from __future__ import annotations

import pytest

from lmcollect.data import keys
from tests.env_adapters import (
    SecondTimePlayer,
    check_prompts_extend_full_tokens,
    collect_turns_in_ray,
    counting_player,
    check_whole_groups,
    make_counting_env,
    make_reasoning_gym_env,
    make_skyrl_gym_env,
    skyrl_gym_player,
)

pytestmark = pytest.mark.integration
pytest.importorskip("reasoning_gym")  # the optional extras; make test installs them
pytest.importorskip("skyrl_gym")


@pytest.mark.parametrize(
    "kind, make_env_, player",
    [
        ("lockstep", make_reasoning_gym_env, SecondTimePlayer()),
        ("continuous", make_reasoning_gym_env, SecondTimePlayer()),
        ("lockstep", make_skyrl_gym_env, skyrl_gym_player),
        ("continuous", make_skyrl_gym_env, skyrl_gym_player),
        ("lockstep", make_counting_env, counting_player),
    ],
    ids=["reasoning-gym-lockstep", "reasoning-gym-continuous", "skyrl-gym-lockstep", "skyrl-gym-continuous", "stateful-lockstep"],
)
def test_a_ray_collector_builds_the_env_in_its_actor_and_keeps_turns_token_exact(ray_cluster, kind, make_env_, player) -> None:
    turns = collect_turns_in_ray(kind, make_env_, player, 16)
    assert check_prompts_extend_full_tokens(turns) >= 4
    assert max(float(t[keys.NEXT_REWARD]) for t in turns) == 1.0
    assert check_whole_groups(turns, 2) >= 2
