"""Experiment loggers a training loop can use: JSON lines, TensorBoard, Weights & Biases.

    from lmcollect.loggers import make_logger

    with make_logger("tensorboard", run_dir, config=vars(args)) as log:
        for step in range(1, num_steps + 1):
            log.log({"reward/mean": reward, "loss": loss}, step=step)
        log.log_image("training", run_dir / "training.png", step=step)

TensorBoard and W&B need ``pip install 'lmcollect[loggers]'``; asking for one that is not
installed raises :class:`MissingLoggerPackage` naming that extra.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lmcollect.loggers.base import (
    LOGGER_KINDS,
    ExperimentLogger,
    LoggerBase,
    LoggerKind,
    MissingLoggerPackage,
    MultiLogger,
    check_available,
)
from lmcollect.loggers.jsonl import JsonlLogger

__all__ = [
    "LOGGER_KINDS",
    "ExperimentLogger",
    "JsonlLogger",
    "LoggerBase",
    "LoggerKind",
    "MissingLoggerPackage",
    "MultiLogger",
    "check_available",
    "make_logger",
]


def make_logger(kind: str, run_dir: str | Path, config: Mapping[str, Any] | None = None, **options: Any) -> LoggerBase:
    """A logger of ``kind`` (``jsonl``, ``tensorboard`` or ``wandb``) writing under ``run_dir``.

    ``jsonl``: ``run_dir/metrics.jsonl`` (and ``config.json``); ``tensorboard``: event files in
    ``run_dir/tensorboard``; ``wandb``: an offline run in ``run_dir/wandb`` (``options`` go to
    :class:`~lmcollect.loggers.wandb_logger.WandbLogger`: project, name, mode). ``config`` is
    recorded with the run.
    """
    check_available(kind)
    if options and kind != "wandb":
        raise TypeError(f"the {kind} logger takes no options, got {sorted(options)}.")
    if kind == "jsonl":
        return JsonlLogger(run_dir, config=config)
    if kind == "tensorboard":
        from lmcollect.loggers.tensorboard_logger import TensorBoardLogger  # imports torch's SummaryWriter

        return TensorBoardLogger(Path(run_dir) / "tensorboard", config=config)
    from lmcollect.loggers.wandb_logger import WandbLogger  # imports wandb

    return WandbLogger(run_dir, config=config, **options)
