"""Real verifiers (v0) environments for the adapter's tests; ``load_environment`` makes this module a verifiers env id.

``kind="guess"``: a MultiTurnEnv where the env answers "higher"/"lower" until the number is guessed
(reward 1 if the last reply is the number); ``kind="tool"``: a ToolEnv with an ``add`` tool (reward 1
when the final answer is the sum); ``kind="group"``: a SingleTurnEnv whose rubric scores groups.
"""
from __future__ import annotations

import re

import verifiers.legacy as vf
from datasets import Dataset


def _last_number(text: str) -> int | None:
    found = re.findall(r"-?\d+", text or "")
    return int(found[-1]) if found else None


def _last_reply(completion) -> str:
    replies = [m for m in completion if m["role"] == "assistant"]
    return replies[-1]["content"] if replies else ""


def exact_answer(completion, answer, **kwargs) -> float:
    return float(_last_number(_last_reply(completion)) == int(answer))


class GuessEnv(vf.MultiTurnEnv):
    """The user says "higher"/"lower" after each wrong guess; the rollout stops at the right one."""

    async def env_response(self, messages, state, **kwargs):
        guess, answer = _last_number(messages[-1]["content"]), int(state["answer"])
        if guess is None:
            return [vf.UserMessage(content="Write only a number.")]
        return [vf.UserMessage(content="higher" if guess < answer else "lower")]

    @vf.stop
    async def guessed(self, state, **kwargs) -> bool:
        trajectory = state["trajectory"]
        if not trajectory:
            return False
        last = trajectory[-1]["completion"]
        return _last_number(_last_reply(last)) == int(state["answer"])


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


def pair_bonus(completions, answers, **kwargs) -> list[float]:
    """A group reward function (it sees every rollout of the group): what lmcollect refuses."""
    return [1.0 for _ in completions]


def rows(kind: str, num_rows: int) -> Dataset:
    if kind == "tool":
        questions = [(f"What is {k} + {k + 10}? Use the add tool.", str(2 * k + 10)) for k in range(num_rows)]
    else:
        questions = [(f"Guess my number from 0 to 9 (game {k}).", str((3 * k + 1) % 10)) for k in range(num_rows)]
    return Dataset.from_list([{"question": q, "answer": a} for q, a in questions])


def load_environment(kind: str = "guess", num_rows: int = 8) -> vf.Environment:
    if kind == "guess":
        return GuessEnv(dataset=rows(kind, num_rows), rubric=vf.Rubric(funcs=[exact_answer]), max_turns=5)
    if kind == "tool":
        return vf.ToolEnv(dataset=rows(kind, num_rows), tools=[add], rubric=vf.Rubric(funcs=[exact_answer]), max_turns=4)
    if kind == "group":
        return vf.SingleTurnEnv(dataset=rows(kind, num_rows), rubric=vf.Rubric(funcs=[exact_answer, pair_bonus]))
    raise ValueError(f"kind must be 'guess', 'tool' or 'group', got {kind!r}")


def bisecting_player(history) -> str:
    """Finds the number 0..9 from the hints (at most 4 guesses)."""
    low, high, guess = 0, 9, None
    for message in history.messages:
        if message.role == "assistant":
            guess = _last_number(message.content)
        elif message.role == "user" and guess is not None:
            low, high = (guess + 1, high) if message.content == "higher" else (low, guess - 1)
    return str((low + high) // 2)


def adding_player(history) -> str:
    """Calls add(k, k + 10), then answers the tool's result."""
    tool_results = [m.content for m in history.messages if m.role == "tool"]
    if tool_results:
        return f"The answer is {tool_results[-1]}."
    question = next(m.content for m in history.messages if m.role == "user")
    a, b = (int(x) for x in re.findall(r"\d+", question)[:2])
    return f'<tool_call>\n{{"name": "add", "arguments": {{"a": {a}, "b": {b}}}}}\n</tool_call>'
