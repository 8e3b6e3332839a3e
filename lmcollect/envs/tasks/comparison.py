"""Generated comparison questions ("Which is larger, 3 or 7?"): learnable by a tiny model in minutes."""

from __future__ import annotations

import random
import re

_NUMBER = re.compile(r"\d+")


def comparison_dataset(num_samples: int, *, seed: int, max_value: int = 9) -> list[dict[str, str]]:
    """``num_samples`` rows ``{"prompt": "Which is larger, 3 or 7?", "answer": "7"}``.

    The two numbers are distinct, drawn uniformly from ``[0, max_value]`` with
    ``random.Random(seed)``, in random order. Score with :class:`~lmcollect.envs.ExactMatchReward`
    (the reply must be the larger number and nothing else). Copying either number scores 0.5 on
    average, so the task has an easy floor to reach and a rule to discover on top of it; with the
    default single digits every number is one token, which is what makes it learnable by the
    ``tiny`` model on a laptop CPU within minutes (the ``lmcollect demo`` task).
    """
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(f"num_samples must be an int >= 1, got {num_samples!r}.")
    if isinstance(max_value, bool) or not isinstance(max_value, int) or max_value < 1:
        raise ValueError(f"max_value must be an int >= 1 (two distinct numbers are needed), got {max_value!r}.")
    rng = random.Random(seed)
    rows = []
    for _ in range(num_samples):
        a, b = rng.sample(range(max_value + 1), 2)
        rows.append({"prompt": f"Which is larger, {a} or {b}?", "answer": str(max(a, b))})
    return rows


def either_number(row: dict[str, str], rng: random.Random) -> str:
    """One of the row's two numbers, at random: a reply in the right format, right half of the time.

    A warm-up on these teaches a fresh model to answer with one of the numbers, not which one.
    """
    return rng.choice(_NUMBER.findall(row["prompt"]))
