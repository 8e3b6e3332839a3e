"""math-verify as a reward backend: ``MathVerifyReward`` compares a reply's math answer with the row's, symbolically.

math-verify (``pip install 'lmcollect[math-verify]'``) parses LaTeX and plain expressions into SymPy
and checks equivalence (``\\frac{1}{2}`` equals ``0.5``, ``x=2`` equals ``2``, sets and intervals
compare as such). Its parser and checker guard themselves with ``signal.alarm`` timeouts, which
only work in the main thread: collectors score in worker threads (``ChatEnv.astep`` runs a task's
``respond`` in one), where math-verify would raise. :class:`MathVerifyReward` passes its timeout in
the main thread and turns it off elsewhere.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lmcollect.compat.extras import import_extra
from lmcollect.data.history import History


def _math_verify() -> Any:
    return import_extra("math_verify", extra="math-verify", who="math-verify rewards")


def thread_safe_timeout(timeout_s: int | None) -> int | None:
    """``timeout_s`` in the main thread; None (no ``signal.alarm``) in any other thread."""
    return timeout_s if threading.current_thread() is threading.main_thread() else None


@dataclass(kw_only=True)
class MathVerifyReward:
    """1.0 when math-verify finds the last assistant message's answer equal to ``sample[answer_key]``; else 0.0.

    The reference is parsed as written and, if that finds nothing, as LaTeX (``$...$``); a reference
    with no math in it is a ValueError naming the row's field. The reply is parsed as math-verify
    does by default (the last ``\\boxed{}``, LaTeX, then plain expressions). Picklable.
    """

    answer_key: str = "answer"
    """Dataset field holding the reference answer (a number, an expression or LaTeX)."""
    timeout_s: int | None = 5
    """math-verify's parse and verify timeout in the main thread (off in worker threads, see the module)."""

    def __post_init__(self) -> None:
        if not isinstance(self.answer_key, str) or not self.answer_key:
            raise ValueError(f"answer_key must be a non-empty str, got {self.answer_key!r}.")
        if self.timeout_s is not None and (isinstance(self.timeout_s, bool) or self.timeout_s < 1):
            raise ValueError(f"timeout_s must be a whole number of seconds >= 1, or None, got {self.timeout_s!r}.")

    def __call__(self, history: History, sample: Mapping[str, Any]) -> float:
        math_verify = _math_verify()
        timeout_s = thread_safe_timeout(self.timeout_s)
        gold = self._gold(math_verify, sample, timeout_s)
        reply = history.last("assistant")
        answer = math_verify.parse("" if reply is None else reply.content, parsing_timeout=timeout_s)
        return 1.0 if answer and math_verify.verify(gold, answer, timeout_seconds=timeout_s) else 0.0

    def _gold(self, math_verify: Any, sample: Mapping[str, Any], timeout_s: int | None) -> list[Any]:
        if self.answer_key not in sample:
            raise KeyError(f"sample has no {self.answer_key!r} field (keys: {sorted(sample)}); add it to the rows.")
        text = str(sample[self.answer_key])
        gold = math_verify.parse(text, parsing_timeout=timeout_s) or math_verify.parse(
            f"${text}$", parsing_timeout=timeout_s
        )
        if not gold:
            raise ValueError(f"sample[{self.answer_key!r}] = {text!r:.80} holds no math answer; fix the dataset row.")
        return gold
