"""The experiment-logger interface (scalars per step, images, close) and what each kind needs installed."""

from __future__ import annotations

import importlib.util
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol

from lmcollect.plumbing import ClosesOnExit

LoggerKind = Literal["jsonl", "tensorboard", "wandb"]
"""``jsonl``: metrics.jsonl in the run folder; ``tensorboard``: event files; ``wandb``: a W&B run."""

LOGGER_KINDS: tuple[str, ...] = typing.get_args(LoggerKind)

REQUIRED_PACKAGES: dict[str, str] = {"tensorboard": "tensorboard", "wandb": "wandb"}
"""The package each kind imports (kinds not listed need nothing beyond lmcollect)."""

PIP_EXTRA = "lmcollect[loggers]"


class MissingLoggerPackage(ImportError):
    """A logger kind was asked for whose package is not installed; the message names the pip extra."""


def check_available(kind: str) -> None:
    """Raise ValueError for an unknown kind, :class:`MissingLoggerPackage` if its package is missing."""
    if kind not in LOGGER_KINDS:
        raise ValueError(f"unknown logger {kind!r}; use one of {', '.join(LOGGER_KINDS)}.")
    package = REQUIRED_PACKAGES.get(kind)
    if package is not None and importlib.util.find_spec(package) is None:
        raise MissingLoggerPackage(
            f"the {kind} logger needs the {package!r} package, which is not installed: "
            f"pip install '{PIP_EXTRA}' (or pip install {package})."
        )


class ExperimentLogger(Protocol):
    """What a training loop calls: one ``log`` per step, ``log_image`` for plots, ``close`` at the end."""

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Record ``metrics`` (keys as paths, e.g. ``"reward/mean"``) at training step ``step``."""
        ...

    def log_image(self, name: str, path: str | Path, step: int) -> None:
        """Record the image file ``path`` (e.g. a PNG plot) under ``name`` at ``step``."""
        ...

    def close(self) -> None:
        """Flush and release (idempotent)."""
        ...


class LoggerBase(ClosesOnExit):
    """Context-manager support for loggers: ``with make_logger(...) as log:`` closes it on the way out.

    A subclass implements the :class:`ExperimentLogger` methods."""

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        raise NotImplementedError

    def log_image(self, name: str, path: str | Path, step: int) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class MultiLogger(LoggerBase):
    """Sends every call to each of ``loggers`` in order (e.g. metrics.jsonl and TensorBoard)."""

    def __init__(self, loggers: Sequence[ExperimentLogger]) -> None:
        self.loggers = list(loggers)

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        for logger in self.loggers:
            logger.log(metrics, step)

    def log_image(self, name: str, path: str | Path, step: int) -> None:
        for logger in self.loggers:
            logger.log_image(name, path, step)

    def close(self) -> None:
        """Close every logger, even when one fails; then raise the first failure."""
        errors: list[Exception] = []
        for logger in self.loggers:
            try:
                logger.close()
            except Exception as exc:  # designed: one broken sink must not keep the others' files open
                errors.append(exc)
        if errors:
            raise errors[0]
