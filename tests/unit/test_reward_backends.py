"""Reward backends of other libraries: TRL-style reward functions (no TRL needed) and math-verify (the math-verify extra)."""
from __future__ import annotations

import pickle
import re
import threading

import pytest

from lmcollect.compat.trl_rewards import TRLRewardFuncs
from lmcollect.data import History, keys
from lmcollect.envs import ChatEnv, arithmetic_dataset
from tests.env_adapters import collect_turns


def accuracy_reward(completions, solution, **kwargs):
    """TRL-style: completions are strings (standard) or message lists (conversational)."""
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [1.0 if t.strip() == s else 0.0 for t, s in zip(texts, solution)]


def format_reward(completions, prompts, **kwargs):
    assert len(prompts) == len(completions) == 1
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [0.5 if re.fullmatch(r"\d+", t.strip()) else None for t in texts]


def dialog(prompt, reply: str) -> History:
    opening = History.from_text(prompt) if isinstance(prompt, str) else History.from_dicts(prompt)
    return opening.append("assistant", reply)


def test_trl_reward_funcs_score_a_dialog_as_trl_would_call_them() -> None:
    reward = TRLRewardFuncs([accuracy_reward, format_reward], weights=[1.0, 2.0])
    row = {"prompt": "What is 2 + 2?", "solution": "4"}
    assert reward(dialog(row["prompt"], "4"), row) == 1.0 + 2.0 * 0.5
    assert reward(dialog(row["prompt"], "four"), row) == 0.0  # format_reward's None adds nothing
    chat_row = {"prompt": [{"role": "user", "content": "What is 2 + 2?"}], "solution": "4"}
    assert reward(dialog(chat_row["prompt"], "4"), chat_row) == 2.0  # conversational completions too
    assert pickle.loads(pickle.dumps(reward))(dialog(row["prompt"], "4"), row) == 2.0


def test_trl_reward_funcs_refuse_bad_setups_by_name() -> None:
    with pytest.raises(TypeError, match="reward_funcs must be a callable"):
        TRLRewardFuncs([])
    with pytest.raises(ValueError, match="weights must be 2 finite numbers"):
        TRLRewardFuncs([accuracy_reward, format_reward], weights=[1.0])
    two = TRLRewardFuncs(lambda completions, **kw: [1.0, 1.0])
    with pytest.raises(ValueError, match="returned 2 rewards for 1 completion"):
        two(dialog("q", "a"), {"prompt": "q"})


def test_trl_reward_funcs_under_the_continuous_collector() -> None:
    rows = [{**row, "solution": row["answer"]} for row in arithmetic_dataset(16, seed=0)]
    answers = {row["prompt"]: row["answer"] for row in rows}
    env = lambda: ChatEnv(rows, reward_fn=TRLRewardFuncs(accuracy_reward), batch_size=4, repeats=2, seed=0)  # noqa: E731
    turns = collect_turns("continuous", env, lambda h: answers[h.last("user").content], 8)
    assert [float(t[keys.NEXT_REWARD]) for t in turns] == [1.0] * len(turns)


math_verify_needed = pytest.mark.skipif(
    __import__("importlib").util.find_spec("math_verify") is None, reason="the math-verify extra (make test installs it)"
)


@math_verify_needed
def test_math_verify_compares_answers_symbolically() -> None:
    from lmcollect.compat.math_verify_reward import MathVerifyReward

    reward = MathVerifyReward()
    assert reward(dialog("q", "So the answer is $\\boxed{\\frac{1}{2}}$."), {"answer": "0.5"}) == 1.0
    assert reward(dialog("q", "The answer is $\\boxed{3}$."), {"answer": "$\\frac{6}{2}$"}) == 1.0
    assert reward(dialog("q", "The answer is $\\boxed{4}$."), {"answer": "3"}) == 0.0
    assert reward(dialog("q", "I do not know."), {"answer": "3"}) == 0.0
    with pytest.raises(ValueError, match="holds no math answer"):
        reward(dialog("q", "3"), {"answer": ""})
    assert pickle.loads(pickle.dumps(reward)) == reward


@math_verify_needed
def test_math_verify_scores_in_worker_threads_without_signal_alarms() -> None:
    from lmcollect.compat.math_verify_reward import MathVerifyReward, thread_safe_timeout

    results: list[object] = []

    def score() -> None:
        try:
            results.append((thread_safe_timeout(5), MathVerifyReward()(dialog("q", "$\\boxed{2}$"), {"answer": "2"})))
        except Exception as e:  # the test reports what a worker thread raised
            results.append(e)

    worker = threading.Thread(target=score)
    worker.start()
    worker.join()
    assert results == [(None, 1.0)] and thread_safe_timeout(5) == 5
    rows = arithmetic_dataset(16, seed=1)
    answers = {row["prompt"]: f"The answer is $\\boxed{{{row['answer']}}}$." for row in rows}
    env = lambda: ChatEnv(rows, reward_fn=MathVerifyReward(), batch_size=4, repeats=2, seed=0)  # noqa: E731
    turns = collect_turns("continuous", env, lambda h: answers[h.last("user").content], 8)  # scored in worker threads
    assert [float(t[keys.NEXT_REWARD]) for t in turns] == [1.0] * len(turns)
