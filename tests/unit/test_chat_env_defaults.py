"""What a ChatEnv does by default that docs/collectors.md warns about: shuffled prompt order, 0.0 rewards without a scorer."""
from __future__ import annotations

import logging

import pytest

from lmcollect.envs import ChatEnv, MathAnswerReward, PromptDataset, SingleTurnTask
from lmcollect.envs import chat_env as chat_env_module

ROWS = [{"prompt": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(12)]


def _prompt_order(env: ChatEnv, num_resets: int = 3) -> list[str]:
    order = []
    for _ in range(num_resets):
        td = env.reset()
        order += [h.messages[-1].content for h in td.get(("history", "prompt")).tolist()]
    return order


def test_a_plain_list_is_shuffled_by_the_seed() -> None:
    seeded = [_prompt_order(ChatEnv(ROWS, reward_fn=MathAnswerReward(), batch_size=4, seed=s)) for s in (0, 0, 1)]
    assert seeded[0] == seeded[1] != seeded[2]  # same seed, same order; another seed, another order
    assert seeded[0] != [row["prompt"] for row in ROWS]
    assert sorted(seeded[0]) == sorted(row["prompt"] for row in ROWS)  # one pass visits every row once


def test_shuffle_false_keeps_the_list_order_whatever_the_seed() -> None:
    for seed in (0, 1, None):
        env = ChatEnv(PromptDataset(ROWS, shuffle=False), reward_fn=MathAnswerReward(), batch_size=4, seed=seed)
        assert _prompt_order(env) == [row["prompt"] for row in ROWS]


def test_no_reward_fn_warns_once_and_scores_zero(monkeypatch, caplog) -> None:
    monkeypatch.setattr(chat_env_module, "_warned_zero_rewards", False)
    with caplog.at_level(logging.WARNING, logger="lmcollect.envs.chat_env"):
        env = ChatEnv(ROWS, batch_size=2, seed=0)
        ChatEnv(ROWS, batch_size=2, seed=0)
        ChatEnv(ROWS, task=SingleTurnTask(), batch_size=2, seed=0)  # unscored on purpose: no warning needed
    warnings = [r.getMessage() for r in caplog.records if "no reward_fn" in r.getMessage()]
    assert len(warnings) == 1 and "every reward will be 0.0" in warnings[0] and "reward_fn=" in warnings[0]
    td = env.reset()
    td.set(("history", "full"), [h.append("assistant", "2") for h in td.get(("history", "prompt")).tolist()])
    rewards = env.step(td).get(("next", "reward"))
    assert rewards.tolist() == [[0.0], [0.0]]


@pytest.mark.parametrize("kwargs", [{"reward_fn": MathAnswerReward()}, {"task": SingleTurnTask(MathAnswerReward())}])
def test_a_scored_env_does_not_warn(monkeypatch, caplog, kwargs) -> None:
    monkeypatch.setattr(chat_env_module, "_warned_zero_rewards", False)
    with caplog.at_level(logging.WARNING, logger="lmcollect.envs.chat_env"):
        ChatEnv(ROWS, batch_size=2, seed=0, **kwargs)
    assert not [r for r in caplog.records if "no reward_fn" in r.getMessage()]
