"""Outside environments in a Ray collector: a reasoning-gym env named 'ecosystem:name' and a stateful task, built inside the actor."""
from __future__ import annotations

import pytest

from lmcollect.data import History, keys
from lmcollect.data.turns import flatten_turns
from lmcollect.envs import make_env
from lmcollect.testing import ScriptedPolicy
from tests.env_adapters import check_prompts_extend_full_tokens, groups_of

pytestmark = pytest.mark.integration
pytest.importorskip("reasoning_gym")  # the optional extra; make test installs it


def make_reasoning_gym_env():
    return make_env("reasoning-gym:leg_counting", batch_size=4, repeats=2, num_samples=16, seed=0, attempts=2)


def make_second_time_player() -> ScriptedPolicy:
    """Wrong once, then right (every dialog two turns), answers from the same seeded generator."""
    from lmcollect.compat.reasoning_gym import create_generator, reasoning_gym_rows

    answers = {r["question"]: r["answer"] for r in reasoning_gym_rows(create_generator("leg_counting", seed=0, size=16))}

    def player(history: History) -> str:
        question = next(m.content for m in history.messages if m.role == "user")
        tried = any(m.role == "assistant" for m in history.messages)
        return f"<answer>{answers[question]}</answer>" if tried else "<answer>none</answer>"

    return ScriptedPolicy(player)


def make_counting_env():
    from tests.unit.test_env_dialogs import counting_env

    return counting_env(batch_size=4, repeats=2)


def make_counter() -> ScriptedPolicy:
    from tests.unit.test_env_dialogs import counting_player

    return ScriptedPolicy(counting_player)


@pytest.mark.parametrize("make_env_, make_policy", [(make_reasoning_gym_env, make_second_time_player), (make_counting_env, make_counter)])
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
