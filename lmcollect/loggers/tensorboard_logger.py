"""TensorBoard logger: event files under the run folder (needs the ``tensorboard`` package)."""

from __future__ import annotations

import json
import logging
import numbers
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lmcollect.loggers.base import LoggerBase

logger = logging.getLogger(__name__)


class TensorBoardLogger(LoggerBase):
    """Scalars (every numeric metric, tagged by its key), images and the config as text.

    Read back with ``tensorboard --logdir <log_dir>`` or tensorboard's ``EventAccumulator``.
    """

    def __init__(self, log_dir: str | Path, *, config: Mapping[str, Any] | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter  # needs tensorboard: the 'loggers' extra

        self.log_dir = Path(log_dir)
        self._writer = SummaryWriter(log_dir=str(self.log_dir))
        self._closed = False
        if config:
            # indented lines are a code block in TensorBoard's markdown text view
            text = "\n".join("    " + line for line in json.dumps(dict(config), indent=2, default=str).splitlines())
            self._writer.add_text("config", text, global_step=0)

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        for key, value in metrics.items():
            if isinstance(value, numbers.Real):
                self._writer.add_scalar(key, float(value), global_step=step)
            else:
                logger.debug("TensorBoardLogger: %s is not a number (%s), not logged", key, type(value).__name__)

    def log_image(self, name: str, path: str | Path, step: int) -> None:
        import numpy as np
        from PIL import Image  # a matplotlib dependency, so always installed with lmcollect

        with Image.open(path) as image:
            pixels = np.asarray(image.convert("RGB"))
        self._writer.add_image(name, pixels, global_step=step, dataformats="HWC")

    def close(self) -> None:
        if not self._closed:
            self._writer.close()
            self._closed = True
