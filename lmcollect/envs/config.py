"""ChatEnvConfig: the batch, grouping, turn-limit and seeding options of a ChatEnv; how an env takes
``config=`` and keyword overrides of its fields."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, TypeVar

C = TypeVar("C")


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"ChatEnvConfig.{name} must be an int, got {type(value).__name__}.")
    if value < minimum:
        raise ValueError(f"ChatEnvConfig.{name} must be >= {minimum}, got {value}.")


@dataclass(kw_only=True)
class ChatEnvConfig:
    """Options of :class:`~lmcollect.envs.ChatEnv`."""

    batch_size: int = 1
    """Number of dialogs run side by side (the env's ``batch_size`` is ``(batch_size,)``)."""
    system_prompt: str | None = None
    """System message put before each prompt (unless the row's message list starts with one)."""
    repeats: int = 1
    """Group size: ``repeats`` consecutive elements answer the same prompts (GRPO groups)."""
    max_turns: int = 1
    """Assistant turns per dialog; reaching it while the task goes on ends it as truncated."""
    seed: int | None = None
    """Seed of the prompt order and task randomness; None draws one from the OS, so a shuffled
    dataset (a plain list of rows is one) is visited in a different order on every run."""

    def __post_init__(self) -> None:
        _check_int("batch_size", self.batch_size, 1)
        _check_int("repeats", self.repeats, 1)
        _check_int("max_turns", self.max_turns, 1)
        if self.batch_size % self.repeats:
            raise ValueError(
                f"ChatEnvConfig.batch_size ({self.batch_size}) must be a multiple of repeats ({self.repeats}); "
                f"use e.g. batch_size={self.repeats * max(1, self.batch_size // self.repeats)}."
            )
        if self.system_prompt is not None and not isinstance(self.system_prompt, str):
            raise TypeError(
                f"ChatEnvConfig.system_prompt must be a str or None, got {type(self.system_prompt).__name__}."
            )
        if self.seed is not None:
            _check_int("seed", self.seed, -(2**63))

    @property
    def num_groups(self) -> int:
        return self.batch_size // self.repeats


def config_with_overrides(config_cls: type[C], config: C | None, overrides: dict[str, Any], *, owner: str) -> C:
    """``config`` (None: ``config_cls()``) with the fields ``overrides`` names replaced: an env's
    ``config=`` and its ``**config_kwargs``. A ``config`` of another type, or a keyword that is no
    field of ``config_cls``, raises TypeError naming ``owner`` and the valid fields."""
    name = config_cls.__name__
    if config is not None and not isinstance(config, config_cls):
        article = "an" if name[0] in "AEIOU" else "a"
        raise TypeError(f"config must be {article} {name}, got {type(config).__name__}.")
    names = {f.name for f in dataclasses.fields(config_cls)}  # type: ignore[arg-type]
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise TypeError(f"{owner} got unknown keyword argument(s) {unknown}; valid config fields: {sorted(names)}.")
    return dataclasses.replace(config or config_cls(), **overrides)  # type: ignore[type-var]
