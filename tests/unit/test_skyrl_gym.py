"""The skyrl-gym adapter on real skyrl-gym envs (the skyrl-gym extra): gsm8k from rows, names, refusals, both collectors with groups."""
from __future__ import annotations

import pickle

import pytest
import torch

from lmcollect.data import History, keys
from lmcollect.envs import ChatEnv, make_env

skyrl_gym = pytest.importorskip("skyrl_gym")  # the optional extra; make test installs it

from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput  # noqa: E402 - after the extra's check

from lmcollect.compat.skyrl_gym import SkyrlGymTask, skyrl_gym_env  # noqa: E402
from tests.env_adapters import check_prompts_extend_full_tokens, collect_turns, dialogs_of, groups_of  # noqa: E402


def gsm8k_rows(num_rows: int = 6, *, env_class: str = "gsm8k_multi_turn") -> list[dict]:
    """skyrl-gym dataset rows as its gsm8k recipe writes them (prompt messages, reward_spec, extra_info)."""
    return [
        {
            "prompt": [{"role": "user", "content": f"What is {k} + {k + 1}? End with '#### ANSWER'."}],
            "env_class": env_class,
            "reward_spec": {"method": "rule", "ground_truth": str(2 * k + 1)},
            "extra_info": {"max_turns": 3},
        }
        for k in range(num_rows)
    ]


def second_time_player(history: History) -> str:
    """Wrong once, then right: every gsm8k_multi_turn dialog has two turns."""
    question = history.messages[0].content
    a, b = (int(x) for x in question.removeprefix("What is ").split("?")[0].split(" + "))
    tried = any(m.role == "assistant" for m in history.messages)
    return f"So #### {a + b}" if tried else "Maybe #### -1"


class RewritingEnv(BaseTextEnv):
    """A skyrl-gym env that rewrites the reply (postprocessed_action), which lmcollect refuses."""

    def __init__(self, env_config=None, extras=None):
        super().__init__()

    def step(self, action: str) -> BaseTextEnvStepOutput:
        return BaseTextEnvStepOutput(observations=[], reward=0.0, done=True, metadata={}, postprocessed_action=action[:3])


if "lmcollect_test_rewriting" not in skyrl_gym.registry:
    skyrl_gym.register(id="lmcollect_test_rewriting", entry_point=RewritingEnv)


def step_with(env: ChatEnv, reply) -> object:
    td = env.reset()
    td[keys.HISTORY_FULL] = [p.append("assistant", reply(p)) for p in td[keys.HISTORY_PROMPT]]
    return env.step(td)


def test_gsm8k_rows_score_through_skyrl_gyms_own_env() -> None:
    env = make_env("skyrl-gym:gsm8k", rows=gsm8k_rows(4, env_class="gsm8k"), batch_size=4, seed=0)
    try:
        assert isinstance(env, ChatEnv) and isinstance(env.task, SkyrlGymTask)
        out = step_with(env, lambda p: second_time_player(History(p.messages[-1:]).append("assistant", "x")))
        assert out["next", keys.REWARD].flatten().tolist() == [1.0] * 4
        assert out["next", keys.DONE].all()
    finally:
        env.close()


def test_multi_turn_observations_are_the_next_prompts_messages() -> None:
    env = skyrl_gym_env(None, rows=gsm8k_rows(2), batch_size=2, max_turns=3)  # env_class of each row
    try:
        out = step_with(env, lambda p: "Maybe #### -1")
        prompt = out["next", keys.HISTORY_PROMPT][0]
        assert [m.role for m in prompt.messages] == ["user", "assistant", "user"]
        assert "#### ANSWER" in prompt.messages[-1].content and not out["next", keys.DONE].any()
        assert out["next", keys.REWARD].flatten().tolist() == [pytest.approx(0.2 / 3)] * 2  # its format score
    finally:
        env.close()


def test_refusals_name_the_fix() -> None:
    with pytest.raises(ValueError, match="pass rows="):
        make_env("skyrl-gym:gsm8k")
    with pytest.raises(ValueError, match=r"skyrl-gym has no env 'nope'; registered: .*gsm8k"):
        make_env("skyrl-gym:nope", rows=gsm8k_rows(1))
    env = skyrl_gym_env("lmcollect_test_rewriting", rows=gsm8k_rows(1))
    try:
        with pytest.raises(Exception, match="postprocessed_action: it rewrites the model's reply"):
            step_with(env, lambda p: "a reply")
    finally:
        env.close()
    assert pickle.loads(pickle.dumps(SkyrlGymTask("gsm8k", max_turns=2))) == SkyrlGymTask("gsm8k", max_turns=2)


@pytest.mark.parametrize("kind", ["lockstep", "continuous"])
def test_under_both_collectors_with_groups_each_turn_extends_the_previous_tokens(kind: str) -> None:
    turns = collect_turns(
        kind,
        lambda: make_env("skyrl-gym:gsm8k_multi_turn", rows=gsm8k_rows(8), batch_size=4, repeats=2, max_turns=3),
        second_time_player,
        16,
    )
    assert check_prompts_extend_full_tokens(turns) >= 4
    for dialog in dialogs_of(turns):
        assert [float(t[keys.NEXT_REWARD]) for t in dialog] == pytest.approx([0.2 / 3, 1.0][: len(dialog)])
    dialogs_per_group = [len({int(t[keys.TRAJ_IDS]) for t in g}) for g in groups_of(turns).values()]
    assert max(dialogs_per_group) == 2  # GRPO groups of 2 dialogs per row


def test_a_restore_replays_each_skyrl_gym_env_to_where_it_was() -> None:
    """gsm8k_multi_turn counts its turns (the last one asks for only the answer): a restored env must have counted the same."""
    make = lambda: skyrl_gym_env("gsm8k_multi_turn", rows=gsm8k_rows(2), batch_size=2, max_turns=3)  # noqa: E731
    env, restored = make(), make()
    try:
        td = env.reset()
        for _ in range(2):  # two wrong answers: the third prompt is the "final answer" one
            td[keys.HISTORY_FULL] = [p.append("assistant", "Maybe #### -1") for p in td[keys.HISTORY_PROMPT]]
            td = env.step(td)["next"].exclude(keys.REWARD, keys.DONE, keys.TERMINATED, keys.TRUNCATED)
        restored.load_state_dict(env.state_dict())
        assert [restored._states[i].env.turns for i in range(2)] == [2, 2]  # replayed through fresh skyrl-gym envs
        want = env.step(td.clone().set(keys.HISTORY_FULL, [p.append("assistant", "#### 0") for p in td[keys.HISTORY_PROMPT]]))
        got = restored.step(td.clone().set(keys.HISTORY_FULL, [p.append("assistant", "#### 0") for p in td[keys.HISTORY_PROMPT]]))
        assert torch.equal(got["next", keys.DONE], want["next", keys.DONE]) and bool(want["next", keys.DONE].all())
    finally:
        env.close()
        restored.close()
