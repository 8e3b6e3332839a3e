"""Generated arithmetic questions ("What is 12 + 7?") small enough for a tiny model to learn."""

from __future__ import annotations

import operator
import random
from collections.abc import Sequence

_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.floordiv}


def _check_positive_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}.")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}.")


def _question(rng: random.Random, op: str, max_operand: int) -> tuple[int, int, int]:
    if op == "/":  # exact division only: a = b * q
        b, q = rng.randint(1, max_operand), rng.randint(0, max_operand)
        return b * q, b, q
    a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
    return a, b, _OPS[op](a, b)


def arithmetic_dataset(
    num_samples: int,
    *,
    seed: int,
    max_operand: int = 20,
    ops: Sequence[str] = ("+", "-"),
) -> list[dict[str, str]]:
    """``num_samples`` rows ``{"prompt": "What is 12 + 7?", "answer": "19"}``.

    Operands are drawn uniformly from ``[0, max_operand]`` with ``random.Random(seed)``; "/" is
    exact integer division (the dividend is a multiple of the divisor), "-" may go negative.
    Score them with :class:`~lmcollect.envs.MathAnswerReward` or ``ExactMatchReward``.
    """
    _check_positive_int("num_samples", num_samples, 1)
    _check_positive_int("max_operand", max_operand, 1)
    if isinstance(ops, str) or not ops or any(op not in _OPS for op in ops):
        raise ValueError(f"ops must be a non-empty list drawn from {sorted(_OPS)}, got {ops!r}.")
    rng = random.Random(seed)
    rows = []
    for _ in range(num_samples):
        op = rng.choice(list(ops))
        a, b, result = _question(rng, op, max_operand)
        rows.append({"prompt": f"What is {a} {op} {b}?", "answer": str(result)})
    return rows
