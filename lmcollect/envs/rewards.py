"""Reward functions ``fn(history, sample) -> float`` and the math-answer parser they use."""

from __future__ import annotations

import inspect
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from lmcollect.data.history import History


@runtime_checkable
class RewardFn(Protocol):
    """Scores a dialog: ``fn(history, sample) -> float``; ``sample`` is the dataset row."""

    def __call__(self, history: History, sample: Mapping[str, Any]) -> float: ...


@dataclass(frozen=True)
class _HistoryOnlyReward:
    """Adapts a user callable ``fn(history) -> float`` to the two-argument protocol (picklable)."""

    fn: Callable[[History], float]

    def __call__(self, history: History, sample: Mapping[str, Any]) -> float:
        return self.fn(history)


def _num_positional(fn: Callable[..., Any]) -> int | None:
    """How many positional arguments ``fn`` accepts (None: unknown or unbounded)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # some builtins have no signature
        return None
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
        return None
    return sum(p.kind in kinds for p in params)


def as_reward_fn(fn: Callable[..., float]) -> RewardFn:
    """Accept ``fn(history, sample)`` as is, and wrap a one-argument ``fn(history)``."""
    if not callable(fn):
        raise TypeError(f"reward_fn must be callable as fn(history, sample) or fn(history), got {type(fn).__name__}.")
    n = _num_positional(fn)
    if n == 0:
        raise TypeError(f"reward_fn {fn!r} takes no positional argument; it must accept (history[, sample]).")
    if n == 1:
        return _HistoryOnlyReward(fn)
    return fn


def _last_assistant_text(history: History) -> str:
    msg = history.last("assistant")
    return "" if msg is None else msg.content


def _sample_answer(sample: Mapping[str, Any], key: str) -> Any:
    if key not in sample:
        raise KeyError(f"sample has no {key!r} field (keys: {sorted(sample)}); add it to the dataset rows.")
    return sample[key]


@dataclass(kw_only=True)
class ExactMatchReward:
    """1.0 when the last assistant message, stripped, equals ``sample[answer_key]``; else 0.0."""

    answer_key: str = "answer"
    """Dataset field holding the reference answer (converted with ``str``)."""
    case_sensitive: bool = True
    """Compare letter case too; set False to compare lower-cased strings."""

    def __post_init__(self) -> None:
        if not isinstance(self.answer_key, str) or not self.answer_key:
            raise ValueError(f"answer_key must be a non-empty str, got {self.answer_key!r}.")

    def __call__(self, history: History, sample: Mapping[str, Any]) -> float:
        got = _last_assistant_text(history).strip()
        want = str(_sample_answer(sample, self.answer_key)).strip()
        if not self.case_sensitive:
            got, want = got.lower(), want.lower()
        return 1.0 if got == want else 0.0


_NUMBER = r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:/\d+)?"
_NUMBER_RE = re.compile(_NUMBER)
_HASH_RE = re.compile(r"####\s*\$?\s*(" + _NUMBER + ")")
_FRAC_RE = re.compile(r"\\d?frac\{\s*(-?[\d.]+)\s*\}\{\s*(-?[\d.]+)\s*\}")


def _to_float(token: str) -> float | None:
    token = token.replace(",", "")
    try:
        if "/" in token:
            num, den = token.split("/", 1)
            return float(num) / float(den)
        return float(token)
    except (ValueError, ZeroDivisionError):
        return None


def _last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}``, with nested braces matched."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def _parse_number(text: str) -> float | None:
    frac = _FRAC_RE.search(text)
    if frac:
        return _to_float(f"{frac.group(1)}/{frac.group(2)}")
    numbers = _NUMBER_RE.findall(text)
    return _to_float(numbers[-1]) if numbers else None


def extract_math_answer(text: str) -> tuple[float | None, bool]:
    """The final numeric answer of ``text`` and whether it was explicitly formatted.

    Looks, in order, for the last ``#### 42``, the last ``\\boxed{42}``, then any last number.
    Returns ``(value, formatted)``; ``value`` is None when no number is found.
    """
    hashes = _HASH_RE.findall(text)
    if hashes:
        return _to_float(hashes[-1]), True
    boxed = _last_boxed(text)
    if boxed is not None:
        return _parse_number(boxed), True
    return _parse_number(text), False


def parse_math_answer(text: str) -> float | None:
    """The final numeric answer of ``text`` (see :func:`extract_math_answer`), or None."""
    return extract_math_answer(text)[0]


@dataclass(kw_only=True)
class MathAnswerReward:
    """1.0 when the final number of the last assistant message equals ``sample[answer_key]``.

    The reply's answer is read from ``#### 42``, else ``\\boxed{42}``, else its last number; the
    reference goes through the same parser, so GSM8K-style solutions ending in ``#### 42`` work.
    ``format_bonus`` is added when the reply used ``####`` or ``\\boxed{}`` (right or wrong).
    """

    answer_key: str = "answer"
    """Dataset field holding the reference answer (a number or text containing one)."""
    format_bonus: float = 0.0
    """Extra reward for an explicitly formatted answer (``####`` or ``\\boxed{}``)."""
    tolerance: float = 1e-6
    """Absolute tolerance of the numeric comparison."""

    def __post_init__(self) -> None:
        if not isinstance(self.answer_key, str) or not self.answer_key:
            raise ValueError(f"answer_key must be a non-empty str, got {self.answer_key!r}.")
        if not math.isfinite(self.format_bonus):
            raise ValueError(f"format_bonus must be a finite float, got {self.format_bonus}.")
        if self.tolerance < 0:
            raise ValueError(f"tolerance must be >= 0, got {self.tolerance}.")

    def __call__(self, history: History, sample: Mapping[str, Any]) -> float:
        want_raw = _sample_answer(sample, self.answer_key)
        want = float(want_raw) if isinstance(want_raw, (int, float)) else parse_math_answer(str(want_raw))
        if want is None:
            raise ValueError(f"sample[{self.answer_key!r}] = {want_raw!r} holds no number; fix the dataset row.")
        got, formatted = extract_math_answer(_last_assistant_text(history))
        correct = got is not None and abs(got - want) <= self.tolerance
        return (1.0 if correct else 0.0) + (self.format_bonus if formatted else 0.0)
