"""A multi-turn calculator-tool task with seeded tool latency: the workload of continuous collection.

A row asks for a chain of operations ("Start from 7, add 3, multiply by 2. ..."). Each assistant
turn either calls the calculator (``CALC: 7 + 3``), answered after a latency drawn from the
dialog's seed (``RESULT: 10``), or gives the final answer (``ANSWER: 20``), which ends the dialog
with reward 1.0 if right, else 0.0. The chain length sets the turns of a dialog (one call per
operation, then the answer: 3 to 5 turns by default), drawn from the dataset's seed, so every
collector and benchmark mode sees the same work and the same latencies.
"""

from __future__ import annotations

import asyncio
import operator
import random
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lmcollect.data.history import History
from lmcollect.envs.tasks.base import MAX_ANSWER_DIGITS, TaskReply, parse_model_int

_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
_OP_WORDS = {"+": "add {}", "-": "subtract {}", "*": "multiply by {}"}
_CALC_RE = re.compile(r"CALC:\s*(-?\d+)\s*([-+*])\s*(-?\d+)")
_ANSWER_RE = re.compile(r"ANSWER:\s*(-?\d+)")
_STEP_RE = re.compile(r"(add|subtract|multiply by) (-?\d+)")
_START_RE = re.compile(r"Start from (-?\d+)")
_WORD_OPS = {"add": "+", "subtract": "-", "multiply by": "*"}

INSTRUCTIONS = (
    "Use the calculator for every step: write 'CALC: a op b' (op is +, - or *) and I reply "
    "'RESULT: n'. When done, write 'ANSWER: n'."
)


@dataclass(frozen=True, slots=True)
class ToolCalcState:
    """One dialog's answer and latency seed (immutable: progress is read from the history)."""

    answer: int
    """The value of the whole chain."""
    num_turns: int
    """Turns the dialog is allowed: one tool call per operation, then the answer."""
    latency_seed: int
    """Seeds the latency of each tool call of this dialog (see :meth:`ToolCalcTask.latency_s_of`)."""


@dataclass(kw_only=True)
class ToolCalcTask:
    """Calculator tool dialogs whose tool calls take a seeded time.

    Reward 1.0 on the turn that gives the right ``ANSWER:``, 0.0 on every other turn (reward at the
    end). A tool call (``CALC: a op b``) is answered ``RESULT: n`` after ``latency_s_of(state,
    turn)`` seconds, uniform in ``[min_latency_s, max_latency_s]`` and drawn from the dialog's seed
    and the turn index. A reply with neither gets "Write 'CALC: a op b' or 'ANSWER: n'." at once.
    The dialog ends (terminated, reward 0.0) when its turns run out without a right answer.

    ``respond`` sleeps (``time.sleep``); ``arespond`` awaits (``asyncio.sleep``), so the continuous
    collector keeps generating for other dialogs meanwhile. Set ``ChatEnvConfig.max_turns`` to at
    least the rows' ``"num_turns"`` (:func:`tool_calc_dataset` draws 3 to 5 by default).
    """

    min_latency_s: float = 0.0
    """Shortest tool latency."""
    max_latency_s: float = 0.3
    """Longest tool latency (0 with ``min_latency_s=0``: no waiting)."""

    def __post_init__(self) -> None:
        if not 0 <= self.min_latency_s <= self.max_latency_s:
            raise ValueError(
                f"need 0 <= min_latency_s <= max_latency_s, got {self.min_latency_s} and {self.max_latency_s}; "
                "e.g. min_latency_s=0.0, max_latency_s=0.3."
            )

    def start(self, sample: Mapping[str, Any], rng: random.Random) -> ToolCalcState:
        return ToolCalcState(
            answer=int(sample["answer"]), num_turns=int(sample["num_turns"]), latency_seed=rng.getrandbits(63)
        )

    def latency_s_of(self, state: ToolCalcState, turn: int) -> float:
        """The latency of the tool call at assistant turn ``turn`` (0-based) of this dialog."""
        if self.max_latency_s == 0:
            return 0.0
        return random.Random(state.latency_seed * 64 + turn).uniform(self.min_latency_s, self.max_latency_s)

    def respond(self, state: ToolCalcState, history: History) -> TaskReply:
        reply, wait_s = self._reply(state, history)
        if wait_s > 0:
            time.sleep(wait_s)
        return reply

    async def arespond(self, state: ToolCalcState, history: History) -> TaskReply:
        reply, wait_s = self._reply(state, history)
        if wait_s > 0:
            await asyncio.sleep(wait_s)
        return reply

    def _reply(self, state: ToolCalcState, history: History) -> tuple[TaskReply, float]:
        """The reply and how long the tool takes to give it (0 when no tool is called)."""
        turn = sum(m.role == "assistant" for m in history.messages) - 1
        last = history.last("assistant")
        text = last.content if last is not None else ""
        answer = _ANSWER_RE.search(text)
        if answer is not None and parse_model_int(answer.group(1)) == state.answer:
            return TaskReply(reward=1.0, done=True), 0.0
        if turn + 1 >= state.num_turns:
            return TaskReply(reward=0.0, done=True, env_message=f"Out of turns. The answer was {state.answer}."), 0.0
        if answer is not None:
            return TaskReply(reward=0.0, done=False, env_message="Wrong answer; keep calculating."), 0.0
        call = _CALC_RE.search(text)
        if call is None:
            return TaskReply(reward=0.0, done=False, env_message="Write 'CALC: a op b' or 'ANSWER: n'."), 0.0
        a, op, b = parse_model_int(call.group(1)), call.group(2), parse_model_int(call.group(3))
        if a is None or b is None:
            message = f"The calculator takes numbers of at most {MAX_ANSWER_DIGITS} digits."
            return TaskReply(reward=0.0, done=False, env_message=message), 0.0
        reply = TaskReply(reward=0.0, done=False, env_message=f"RESULT: {_OPS[op](a, b)}")
        return reply, self.latency_s_of(state, turn)


def tool_calc_dataset(
    num_samples: int, *, seed: int, min_turns: int = 3, max_turns: int = 5, max_operand: int = 9
) -> list[dict[str, Any]]:
    """``num_samples`` rows ``{"prompt", "answer", "num_turns"}``: a chain of ``num_turns - 1``
    operations on numbers up to ``max_operand``, ``num_turns`` uniform in ``[min_turns, max_turns]``."""
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(f"num_samples must be an int >= 1, got {num_samples!r}.")
    if not 2 <= min_turns <= max_turns:
        raise ValueError(
            f"need 2 <= min_turns <= max_turns (one call and the answer at least), got {min_turns}, {max_turns}."
        )
    rng = random.Random(seed)
    rows = []
    for _ in range(num_samples):
        num_turns = rng.randint(min_turns, max_turns)
        start = value = rng.randint(0, max_operand)
        words = []
        for _ in range(num_turns - 1):
            op, operand = rng.choice(sorted(_OPS)), rng.randint(1, max_operand)
            value = _OPS[op](value, operand)
            words.append(_OP_WORDS[op].format(operand))
        prompt = f"Start from {start}, then " + ", then ".join(words) + f". {INSTRUCTIONS}"
        rows.append({"prompt": prompt, "answer": str(value), "num_turns": num_turns})
    return rows


def tool_calc_player(history: History) -> str:
    """A scripted reference player: one ``CALC:`` per operation, then the right ``ANSWER:``.

    It reads the chain from the opening prompt and the results from the tool's replies, so with
    :class:`~lmcollect.policies.ScriptedPolicy` (or a scripted engine) a dialog runs exactly its
    ``num_turns`` turns and earns 1.0.
    """
    opening = next((m.content for m in history.messages if m.role == "user"), "")
    start = _START_RE.search(opening)
    steps = [(_WORD_OPS[name], int(operand)) for name, operand in _STEP_RE.findall(opening)]
    value = int(start.group(1)) if start else 0
    done = 0
    for message in history.messages:
        result = re.match(r"RESULT: (-?\d+)", message.content) if message.role == "user" else None
        if result is not None:
            value, done = int(result.group(1)), done + 1
    if done >= len(steps):
        return f"ANSWER: {value}"
    op, operand = steps[done]
    return f"CALC: {value} {op} {operand}"
