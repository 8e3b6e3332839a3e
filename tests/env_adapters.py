"""Dialogs of an env collected by both collectors over a scripted engine, and the token checks every env adapter passes."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from functools import partial

import torch
from tensordict import TensorDictBase

from lmcollect.collectors import ContinuousLLMCollector, LLMCollector
from lmcollect.data import History, keys
from lmcollect.data.turns import flatten_turns
from lmcollect.policies import EnginePolicy, SamplingConfig
from lmcollect.envs import make_env
from lmcollect.testing import ScriptedPolicy
from lmcollect.testing.scripted_engine import ByteTokenizer, ScriptedEngine, chat_script

SAMPLING = SamplingConfig(max_new_tokens=48)


def collect_turns(
    kind: str,
    make_env: Callable[[], object],
    player: Callable[[History], str],
    num_turns: int,
    sampling: SamplingConfig = SAMPLING,
) -> list:
    """``num_turns`` turns (whole dialogs) of the env ``make_env()`` answered by ``player``, by the
    lockstep (``kind="lockstep"``) or the continuous collector."""
    engine = ScriptedEngine(script=chat_script(player))
    if kind == "lockstep":
        policy = EnginePolicy(engine, tokenizer=ByteTokenizer(), sampling=sampling)
        collector = LLMCollector(make_env(), policy=policy, dialog_turns_per_batch=num_turns, flatten_data=True)
    else:
        collector = ContinuousLLMCollector(
            [make_env()], engine=engine, tokenizer=ByteTokenizer(), sampling=sampling, dialog_turns_per_batch=num_turns
        )
    with collector:
        return flatten_turns(collector.next())


def dialogs_of(turns: list) -> list[list[TensorDictBase]]:
    """The turns grouped by trajectory, each dialog in turn order."""
    dialogs: dict[int, list[TensorDictBase]] = defaultdict(list)
    for turn in turns:
        dialogs[int(turn[keys.TRAJ_IDS])].append(turn)
    return [sorted(d, key=lambda t: int(t[keys.STEP_COUNT])) for d in dialogs.values()]


def check_prompts_extend_full_tokens(turns: list) -> int:
    """Each turn's prompt tokens start with the previous turn's full tokens (nothing re-tokenised);
    returns how many turns followed another."""
    num_checked = 0
    for dialog in dialogs_of(turns):
        for before, after in zip(dialog, dialog[1:]):
            full, prompt = before[keys.TOKENS_FULL], after[keys.TOKENS_PROMPT]
            assert prompt.numel() > full.numel() and torch.equal(prompt[: full.numel()], full), (
                "a prompt does not start with the previous turn's full tokens"
            )
            num_checked += 1
    return num_checked


def check_whole_groups(turns: list, group_size: int) -> int:
    """Every GRPO group in ``turns`` holds ``group_size`` dialogs of one prompt; returns the number of groups."""
    groups = groups_of(turns)
    for group_id, group in groups.items():
        dialogs = {int(t[keys.TRAJ_IDS]) for t in group}
        assert len(dialogs) == group_size, f"group {group_id} holds {len(dialogs)} dialogs, not {group_size}"
        assert len({int(t[keys.ENV_PROMPT_ID]) for t in group}) == 1, f"group {group_id} mixes prompts"
    return len(groups)


def groups_of(turns: list) -> dict[int, list]:
    """Turns by GRPO group id."""
    groups: dict[int, list] = defaultdict(list)
    for turn in turns:
        groups[int(turn[keys.GROUP_ID])].append(turn)
    return groups


# ---- collection in a Ray collector's actor: the env factory and the player travel pickled (by name: they live in
# importable modules, or are picklable objects), the env, the policy or engine are built inside the actor
def collect_turns_in_ray(
    kind: str,
    make_env: Callable[[], object],
    player: Callable[[History], str],
    num_turns: int,
    sampling: SamplingConfig = SAMPLING,
    *,
    dialogs_in_flight: int = 4,
) -> list:
    """``num_turns`` turns of ``make_env()`` answered by ``player``, by a :class:`RayLLMCollector`
    (``kind="lockstep"``, over a :class:`ScriptedPolicy`) or a :class:`RayContinuousLLMCollector` (over a
    :class:`ScriptedEngine`, ``dialogs_in_flight`` slots) in an actor of a quarter CPU; shut down after."""
    from lmcollect.ray.collector import RayLLMCollector
    from lmcollect.ray.continuous import RayContinuousLLMCollector

    common = {"num_cpus": 0.25, "dialog_turns_per_batch": num_turns}
    if kind == "lockstep":
        collector = RayLLMCollector(make_env, policy_factory=partial(ScriptedPolicy, player), flatten_data=True, **common)
    else:
        collector = RayContinuousLLMCollector(
            make_env,
            engine_factory=partial(scripted_engine, player),
            tokenizer=ByteTokenizer(),
            sampling=sampling,
            max_dialogs_in_flight=dialogs_in_flight,
            **common,
        )
    try:
        return flatten_turns(collector.next())
    finally:
        collector.shutdown()


def scripted_engine(player: Callable[[History], str]) -> ScriptedEngine:
    return ScriptedEngine(script=chat_script(player))


def make_reasoning_gym_env():
    return make_env("reasoning-gym:leg_counting", batch_size=4, repeats=2, num_samples=16, seed=0, attempts=2)


class SecondTimePlayer:
    """Answers leg_counting wrong once, then right (every dialog two turns), from the same seeded generator
    (built where it first plays, so only the empty object is pickled)."""

    def __init__(self) -> None:
        self._answers: dict[str, str] | None = None

    def __call__(self, history: History) -> str:
        if self._answers is None:
            from lmcollect.compat.reasoning_gym import create_generator, reasoning_gym_rows

            rows = reasoning_gym_rows(create_generator("leg_counting", seed=0, size=16))
            self._answers = {r["question"]: r["answer"] for r in rows}
        question = next(m.content for m in history.messages if m.role == "user")
        tried = any(m.role == "assistant" for m in history.messages)
        return f"<answer>{self._answers[question]}</answer>" if tried else "<answer>none</answer>"


def make_counting_env():
    from tests.unit.test_env_dialogs import counting_env

    return counting_env(batch_size=4, repeats=2)


def counting_player(history: History) -> str:
    from tests.unit.test_env_dialogs import counting_player as player

    return player(history)


def make_skyrl_gym_env():
    """skyrl-gym's gsm8k_multi_turn on the rows of tests/unit/test_skyrl_gym.py, by its 'skyrl-gym:<id>' name."""
    from tests.unit.test_skyrl_gym import gsm8k_rows

    return make_env("skyrl-gym:gsm8k_multi_turn", rows=gsm8k_rows(8), batch_size=4, repeats=2, max_turns=3)


def skyrl_gym_player(history: History) -> str:
    from tests.unit.test_skyrl_gym import second_time_player

    return second_time_player(history)
