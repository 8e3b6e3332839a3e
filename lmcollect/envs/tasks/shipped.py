"""The tasks that ship with lmcollect, by name: how to generate their prompts and how to score replies."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lmcollect.envs.rewards import ExactMatchReward, MathAnswerReward
from lmcollect.envs.tasks.arithmetic import arithmetic_dataset
from lmcollect.envs.tasks.base import SingleTurnTask, Task
from lmcollect.envs.tasks.comparison import comparison_dataset, either_number
from lmcollect.envs.tasks.guessing import GuessingGameTask, guessing_game_dataset
from lmcollect.envs.tasks.tool_calc import ToolCalcTask, tool_calc_dataset


def _exact_match_task() -> Task:
    return SingleTurnTask(ExactMatchReward())


def _math_answer_task() -> Task:
    return SingleTurnTask(MathAnswerReward())


def _single_digit_arithmetic(num_samples: int, *, seed: int) -> list[dict[str, str]]:
    return arithmetic_dataset(num_samples, seed=seed, max_operand=9, ops=("+",))


@dataclass(frozen=True, kw_only=True)
class ShippedTask:
    """A named task: a prompt generator and the :class:`Task` that scores the replies."""

    name: str
    """What ``--task`` calls it."""
    description: str
    """One line for ``--help`` and error messages."""
    make_rows: Callable[..., list[dict[str, Any]]]
    """``make_rows(num_samples, seed=seed)``: dataset rows with a "prompt" (and an "answer" if any)."""
    make_task: Callable[[], Task]
    """Builds the task that scores each assistant turn (reward, done, env reply)."""
    max_turns: int = 1
    """Assistant turns per dialog (``ChatEnvConfig.max_turns``)."""
    has_reference_answers: bool = True
    """Rows carry an "answer" that a supervised warm-up can imitate."""
    format_answer: Callable[[dict[str, Any], random.Random], str] | None = None
    """``format_answer(row, rng)``: a reply in the right format that is right only by chance, for a
    warm-up that teaches the format and leaves the task to RL; None: warm up on the "answer"."""


def _multi_turn_task(
    name: str, description: str, make_rows: Callable[..., list[dict[str, Any]]], make_task: Callable[[], Task]
) -> ShippedTask:
    """A task of up to 5 assistant turns whose rows have no reference answer to imitate."""
    return ShippedTask(
        name=name,
        description=description,
        make_rows=make_rows,
        make_task=make_task,
        max_turns=5,
        has_reference_answers=False,
    )


SHIPPED_TASKS: dict[str, ShippedTask] = {
    task.name: task
    for task in (
        ShippedTask(
            name="comparison",
            description="'Which is larger, 3 or 7?', exact match (the demo's task)",
            make_rows=comparison_dataset,
            make_task=_exact_match_task,
            format_answer=either_number,
        ),
        ShippedTask(
            name="addition",
            description="'What is 3 + 5?' with single digits, last number of the reply",
            make_rows=_single_digit_arithmetic,
            make_task=_math_answer_task,
        ),
        ShippedTask(
            name="arithmetic",
            description="'What is 12 - 7?' with operands up to 20, last number of the reply",
            make_rows=arithmetic_dataset,
            make_task=_math_answer_task,
        ),
        _multi_turn_task(
            "guessing",
            "guess a number in [1, 20] in 5 turns, told 'Higher.' / 'Lower.'",
            guessing_game_dataset,
            GuessingGameTask,
        ),
        _multi_turn_task(
            "tool_calc",
            "a chain of 2-4 operations done with a calculator tool (0-300 ms per call), 'ANSWER: n' at the end",
            tool_calc_dataset,
            ToolCalcTask,
        ),
    )
}


def get_shipped_task(name: str) -> ShippedTask:
    """The shipped task called ``name``; a ValueError lists the known names otherwise."""
    if name not in SHIPPED_TASKS:
        known = ", ".join(f"{n} ({t.description})" for n, t in SHIPPED_TASKS.items())
        raise ValueError(f"unknown task {name!r}; shipped tasks: {known}.")
    return SHIPPED_TASKS[name]
