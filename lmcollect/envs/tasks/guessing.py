"""A multi-turn number guessing game: the env answers "Higher." / "Lower." until the guess is right."""

from __future__ import annotations

import random
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lmcollect.data.history import History
from lmcollect.envs.tasks.base import TaskReply, parse_model_int

_INT_RE = re.compile(r"-?\d+")

_TEMPLATES = (
    "Let's play a game. I am thinking of an integer between {low} and {high} (inclusive). "
    "Guess it! After each guess I will reply 'Higher.' or 'Lower.'. You have {turns} guesses. "
    "Answer with a single number.",
    "I picked a secret whole number from {low} to {high}. Try to find it in at most {turns} guesses; "
    "I will tell you 'Higher.' or 'Lower.' after each one. Reply with just the number.",
)


@dataclass(frozen=True, slots=True)
class GuessingState:
    """The secret of one dialog (immutable: progress is read from the history)."""

    secret: int
    low: int
    high: int
    prior_turns: int
    """Assistant messages already in the opening prompt (few-shot), not counted as guesses."""


def _check_bounds(low: int, high: int, max_turns: int | None) -> None:
    for name, value in (("low", low), ("high", high)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}.")
    if high < low:
        raise ValueError(f"high ({high}) must be >= low ({low}); swap or fix them.")
    if max_turns is not None and (isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 1):
        raise ValueError(f"max_turns must be an int >= 1 or None, got {max_turns!r}.")


@dataclass(kw_only=True)
class GuessingGameTask:
    """Guess the secret integer in ``[low, high]``.

    At ``start`` the secret is ``sample["secret"]`` if the row has one, else ``rng.randint``; a
    row's ``"low"`` / ``"high"`` override the task's. Each assistant reply is read for its last
    integer. Per-turn rewards: ``correct_reward`` (1.0) for the right guess, which ends the dialog
    (terminated); ``wrong_reward`` (0.0) for a wrong guess, answered "Higher." or "Lower.";
    ``invalid_reward`` (0.0) for a reply without a number, answered "Please answer with a number
    between low and high.". After ``max_turns`` guesses without success the dialog ends
    (terminated, a lost game) with "Out of guesses! The number was N.".
    Set ``ChatEnvConfig.max_turns >= max_turns``, or the env truncates the game first.
    """

    low: int = 1
    """Smallest possible secret."""
    high: int = 20
    """Largest possible secret."""
    max_turns: int | None = 5
    """Guesses allowed before the game is lost; None: unlimited (the env's max_turns applies)."""
    correct_reward: float = 1.0
    """Reward of the turn that guesses right."""
    wrong_reward: float = 0.0
    """Reward of a wrong guess."""
    invalid_reward: float = 0.0
    """Reward of a reply with no number (use a small negative value to discourage it)."""

    def __post_init__(self) -> None:
        _check_bounds(self.low, self.high, self.max_turns)

    def start(self, sample: Mapping[str, Any], rng: random.Random) -> GuessingState:
        low, high = int(sample.get("low", self.low)), int(sample.get("high", self.high))
        _check_bounds(low, high, self.max_turns)
        secret = int(sample["secret"]) if "secret" in sample else rng.randint(low, high)
        prompt = sample.get("prompt")
        prior = 0 if isinstance(prompt, str) else sum(m.get("role") == "assistant" for m in prompt or ())
        return GuessingState(secret=secret, low=low, high=high, prior_turns=prior)

    def respond(self, state: GuessingState, history: History) -> TaskReply:
        turns = sum(m.role == "assistant" for m in history.messages) - state.prior_turns
        last = history.last("assistant")
        found = _INT_RE.findall(last.content if last is not None else "")
        guess = parse_model_int(found[-1]) if found else None  # None: no number, or an absurdly long one
        if guess == state.secret:
            return TaskReply(reward=self.correct_reward, done=True)
        reward = self.wrong_reward if guess is not None else self.invalid_reward
        if self.max_turns is not None and turns >= self.max_turns:
            return TaskReply(reward=reward, done=True, env_message=f"Out of guesses! The number was {state.secret}.")
        if guess is None:
            message = f"Please answer with a number between {state.low} and {state.high}."
        else:
            message = "Higher." if guess < state.secret else "Lower."
        return TaskReply(reward=reward, done=False, env_message=message)


def guessing_game_dataset(
    num_samples: int, *, seed: int, low: int = 1, high: int = 20, max_turns: int = 5
) -> list[dict[str, Any]]:
    """``num_samples`` rows ``{"prompt": <rules of the game>, "low", "high"}`` (phrasing varies).

    The secret is not in the rows: :class:`GuessingGameTask` draws it from the env's rng.
    """
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(f"num_samples must be an int >= 1, got {num_samples!r}.")
    _check_bounds(low, high, max_turns)
    rng = random.Random(seed)
    return [
        {"prompt": rng.choice(_TEMPLATES).format(low=low, high=high, turns=max_turns), "low": low, "high": high}
        for _ in range(num_samples)
    ]


def binary_search_player(history: History) -> str:
    """A scripted reference player: halves the range after each "Higher." / "Lower." reply.

    It reads the bounds from the opening prompt (the first two integers) and always wins within
    ceil(log2(high - low + 1)) guesses. Use it with ``ScriptedPolicy`` to test collectors.
    """
    opening = history.messages[0].content if history.messages else ""
    bounds = _INT_RE.findall(opening)
    low, high = (int(bounds[0]), int(bounds[1])) if len(bounds) >= 2 else (1, 20)
    guess: int | None = None
    for message in history.messages[1:]:
        if message.role == "assistant":
            numbers = _INT_RE.findall(message.content)
            guess = int(numbers[-1]) if numbers else None
        elif message.role == "user" and guess is not None:
            if message.content.startswith("Higher"):
                low = guess + 1
            elif message.content.startswith("Lower"):
                high = guess - 1
    return str((low + high) // 2)
