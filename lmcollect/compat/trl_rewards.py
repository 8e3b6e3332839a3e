"""TRL-style reward functions as lmcollect rewards: ``TRLRewardFuncs(accuracy_reward, format_reward)``.

TRL's ``GRPOTrainer(reward_funcs=...)`` calls each function on a batch:
``fn(prompts=[...], completions=[...], **columns) -> list[float | None]``, where ``columns`` are
the dataset's other fields, one list each, and a completion is a string, or for a conversational
dataset (a ``prompt`` that is a list of messages) ``[{"role": "assistant", "content": ...}]``.
:class:`TRLRewardFuncs` calls them the same way for one dialog, so functions written for TRL
score lmcollect's turns unchanged; TRL itself is not needed.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lmcollect.data.history import History

TRLRewardFunc = Callable[..., Sequence[float | None]]
"""``fn(prompts=..., completions=..., **columns) -> list[float | None]`` (TRL's reward function)."""


@dataclass
class TRLRewardFuncs:
    """``fn(history, sample)``: the weighted sum of TRL-style reward functions on the last assistant message.

    Each function gets ``prompts=[sample["prompt"]]``, ``completions=[reply]`` and every other field
    of the row as a one-element list (TRL passes ``prompt`` and ``completion`` that way too); a
    function's ``None`` (not applicable to this row, as in TRL) adds 0.0. Picklable when the
    functions are (module-level functions are).
    """

    reward_funcs: TRLRewardFunc | Sequence[TRLRewardFunc]
    """One function or several (their weighted rewards are summed, as TRL does)."""
    weights: Sequence[float] | None = None
    """One weight per function; None: 1.0 each (TRL's ``reward_weights``)."""
    _funcs: tuple[TRLRewardFunc, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        funcs = (self.reward_funcs,) if callable(self.reward_funcs) else tuple(self.reward_funcs)
        if not funcs or not all(callable(f) for f in funcs):
            raise TypeError(
                f"reward_funcs must be a callable or a non-empty list of callables, got {self.reward_funcs!r}."
            )
        weights = [1.0] * len(funcs) if self.weights is None else list(self.weights)
        if len(weights) != len(funcs) or not all(isinstance(w, numbers.Real) and math.isfinite(w) for w in weights):
            raise ValueError(
                f"weights must be {len(funcs)} finite numbers (one per reward function), got {self.weights!r}."
            )
        self._funcs, self.weights = funcs, weights

    def __call__(self, history: History, sample: Mapping[str, Any]) -> float:
        reply = history.last("assistant")
        text = "" if reply is None else reply.content
        prompt = sample.get("prompt")
        completion: Any = text if isinstance(prompt, str) else [{"role": "assistant", "content": text}]
        columns = {key: [value] for key, value in sample.items() if key not in ("prompt", "completion")}
        total = 0.0
        for fn, weight in zip(self._funcs, self.weights or (), strict=True):
            rewards = list(fn(prompts=[prompt], completions=[completion], **columns))
            if len(rewards) != 1:
                raise ValueError(f"reward function {_name(fn)} returned {len(rewards)} rewards for 1 completion.")
            if rewards[0] is not None:
                total += weight * float(rewards[0])
        return total


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__name__", repr(fn))
