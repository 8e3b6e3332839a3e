"""The reasoning-gym adapter on real generators (the reasoning-gym extra): rows, scoring, names, both collectors with groups."""
from __future__ import annotations

import pickle

import pytest

from lmcollect.cli.builders import EnvFactory, resolve_task
from lmcollect.data import History, keys
from lmcollect.envs import ChatEnv, make_env, named_task

reasoning_gym = pytest.importorskip("reasoning_gym")  # the optional extra; make test installs it

from lmcollect.compat.reasoning_gym import (  # noqa: E402 - after the extra's check
    ReasoningGymReward,
    create_generator,
    extract_answer,
    reasoning_gym_env,
    reasoning_gym_rows,
)
from tests.env_adapters import check_prompts_extend_full_tokens, collect_turns, dialogs_of, groups_of  # noqa: E402


def composite(seed: int = 1, size: int = 24):
    from reasoning_gym.composite import DatasetSpec

    specs = [DatasetSpec("basic_arithmetic", 1.0, {}), DatasetSpec("leg_counting", 1.0, {})]
    return reasoning_gym.create_dataset("composite", datasets=specs, seed=seed, size=size)


def reply(answer: str) -> History:
    return History.from_text("q").append("assistant", f"Let me think. <answer>{answer}</answer>")


def test_rows_are_the_generators_entries_and_follow_its_seed() -> None:
    rows = reasoning_gym_rows(create_generator("basic_arithmetic", seed=3, size=8))
    assert len(rows) == 8 and rows == reasoning_gym_rows(create_generator("basic_arithmetic", seed=3, size=8))
    assert rows != reasoning_gym_rows(create_generator("basic_arithmetic", seed=4, size=8))
    entry = create_generator("basic_arithmetic", seed=3, size=8)[0]
    assert rows[0]["question"] == entry["question"] and rows[0]["answer"] == entry["answer"]
    assert rows[0]["prompt"][-1] == {"role": "user", "content": entry["question"]}
    assert reasoning_gym_rows(create_generator("leg_counting", size=2), answer_format=None)[0]["prompt"] == (
        create_generator("leg_counting", size=2)[0]["question"]
    )


def test_the_reward_is_the_generators_own_score_of_the_extracted_answer_and_pickles() -> None:
    generator = create_generator("basic_arithmetic", seed=0, size=16)
    reward = ReasoningGymReward(generator)
    for row in reasoning_gym_rows(generator):
        assert reward(reply(row["answer"]), row) == 1.0
        assert reward(reply(row["answer"] + "0"), row) == generator.score_answer(row["answer"] + "0", row) < 1.0
    row = reasoning_gym_rows(generator, 1)[0]
    assert pickle.loads(pickle.dumps(reward))(reply(row["answer"]), row) == 1.0
    assert extract_answer("<answer>1</answer> then <answer> 2 </answer>") == "2"
    assert extract_answer("  42 ") == "42"  # no tag: the whole reply


def test_a_composite_generator_routes_each_row_to_its_source_scorer() -> None:
    generator = composite()
    rows = reasoning_gym_rows(generator)
    assert {row["metadata"]["source_dataset"] for row in rows} == {"basic_arithmetic", "leg_counting"}
    reward = pickle.loads(pickle.dumps(ReasoningGymReward(generator)))
    assert [reward(reply(str(row["answer"])), row) for row in rows] == [1.0] * len(rows)


def test_the_ecosystems_names_build_envs_and_command_recipes() -> None:
    env = make_env("reasoning-gym:leg_counting", batch_size=4, repeats=2, num_samples=16, seed=0)
    assert isinstance(env, ChatEnv) and env.group_size == 2
    td = env.reset()
    answers = [s["answer"] for s in env.current_samples]
    td[keys.HISTORY_FULL] = [p.append("assistant", f"<answer>{a}</answer>") for p, a in zip(td[keys.HISTORY_PROMPT], answers)]
    assert env.step(td)["next", keys.REWARD].flatten().tolist() == [1.0] * 4
    task = named_task("reasoning-gym:basic_arithmetic")
    assert task is not None and task.max_turns == 1 and task.has_reference_answers
    assert resolve_task("reasoning-gym:basic_arithmetic", flag="--env").name == "reasoning-gym:basic_arithmetic"
    rows = task.make_rows(8, seed=5)
    assert rows == reasoning_gym_rows(create_generator("basic_arithmetic", seed=5, size=8))
    built = EnvFactory(task_name=task.name, rows=rows, num_envs=4, repeats=2, seed=0)()  # what a collector actor builds
    assert isinstance(built, ChatEnv) and built.task.attempts == 1
    shipped_copy = pickle.loads(pickle.dumps(built.task))  # goes to collector actors with the env
    assert shipped_copy.reward(reply(rows[0]["answer"]), rows[0]) == 1.0
    with pytest.raises(ValueError, match="reasoning-gym has no generator 'nope'; its generators: .*basic_arithmetic"):
        make_env("reasoning-gym:nope")


def answer_second_time(rows: list[dict]):
    """A player that answers each question wrongly once, then rightly (so every dialog has two turns)."""
    answers = {row["question"]: str(row["answer"]) for row in rows}

    def player(history: History) -> str:
        question = next(m.content for m in history.messages if m.role == "user")
        tried = sum(m.role == "assistant" for m in history.messages)
        return "<answer>no idea</answer>" if tried == 0 else f"<answer>{answers[question]}</answer>"

    return player


@pytest.mark.parametrize("kind", ["lockstep", "continuous"])
def test_under_both_collectors_with_groups_each_turn_extends_the_previous_tokens(kind: str) -> None:
    generator = composite(seed=2, size=32)
    rows = reasoning_gym_rows(generator)
    turns = collect_turns(
        kind, lambda: reasoning_gym_env(generator, batch_size=4, repeats=2, attempts=2, seed=0), answer_second_time(rows), 16
    )
    assert check_prompts_extend_full_tokens(turns) >= 4
    for dialog in dialogs_of(turns):
        assert [float(t[keys.NEXT_REWARD]) for t in dialog] == [0.0, 1.0][: len(dialog)]
    dialogs_per_group = [len({int(t[keys.TRAJ_IDS]) for t in g}) for g in groups_of(turns).values()]
    assert max(dialogs_per_group) == 2 and min(dialogs_per_group) >= 1  # GRPO groups of 2 answers per question
