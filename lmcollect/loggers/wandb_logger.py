"""Weights & Biases logger: a W&B run under the run folder, offline unless WANDB_MODE says otherwise."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, cast

from lmcollect.loggers.base import LoggerBase

DEFAULT_PROJECT = "lmcollect"
WandbMode = Literal["online", "offline", "disabled", "shared"]


class WandbLogger(LoggerBase):
    """One W&B run: ``log`` is ``run.log(metrics, step=step)``, images go up as ``wandb.Image``.

    ``mode`` defaults to ``$WANDB_MODE`` or ``"offline"``: nothing leaves the machine unless asked;
    ``wandb sync <run_dir>/wandb/offline-run-*`` uploads an offline run later. The run's files are
    under ``run_dir/wandb``. ``project`` defaults to ``$WANDB_PROJECT`` or ``"lmcollect"``, the run
    name to the run folder's name. W&B's console capture is off (it would fight the live display).
    The run file may be completed a moment after :meth:`close` returns (wandb-core writes it).
    """

    def __init__(
        self,
        run_dir: str | Path,
        *,
        config: Mapping[str, Any] | None = None,
        project: str | None = None,
        name: str | None = None,
        mode: str | None = None,
    ) -> None:
        import wandb  # the 'loggers' extra

        self.run_dir = Path(run_dir)
        self.mode = mode or os.environ.get("WANDB_MODE") or "offline"
        self._wandb = wandb
        self.run = wandb.init(
            project=project or os.environ.get("WANDB_PROJECT") or DEFAULT_PROJECT,
            name=name or self.run_dir.name,
            dir=str(self.run_dir),
            mode=cast(WandbMode, self.mode),  # a user's string: wandb's settings validate it
            config=dict(config or {}),
            reinit="create_new",  # a trainer may hold runs of its own
            settings=wandb.Settings(console="off"),
        )
        self._closed = False

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        self.run.log(dict(metrics), step=step)

    def log_image(self, name: str, path: str | Path, step: int) -> None:
        self.run.log({name: self._wandb.Image(str(path))}, step=step)

    def close(self) -> None:
        if not self._closed:
            self.run.finish()
            self._closed = True
