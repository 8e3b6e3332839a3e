"""JSON-lines logger: metrics.jsonl (one line per step) in the run folder, needing nothing installed."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lmcollect.loggers.base import LoggerBase

METRICS_FILE = "metrics.jsonl"
IMAGES_FILE = "images.jsonl"
CONFIG_FILE = "config.json"


class JsonlLogger(LoggerBase):
    """Appends ``{"step": step, **metrics}`` to ``run_dir/metrics.jsonl`` at each :meth:`log`.

    The file is opened per line, so a run stopped with Ctrl-C keeps every finished step.
    :meth:`log_image` lists the image in ``images.jsonl`` (the file itself stays where it is);
    ``config`` (if given) goes to ``config.json``. ``records`` holds what was logged.
    """

    def __init__(self, run_dir: str | Path, *, config: Mapping[str, Any] | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        self.path.touch()
        self.records: list[dict[str, Any]] = []
        if config:
            (self.run_dir / CONFIG_FILE).write_text(
                json.dumps(dict(config), indent=2, default=str) + "\n", encoding="utf-8"
            )

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        if "step" in metrics and metrics["step"] != step:
            raise ValueError(
                f"metrics['step'] is {metrics['step']} but step={step}; drop the key or pass the same step."
            )
        record = {"step": step, **metrics}
        self._append(self.path, record)
        self.records.append(record)

    def log_image(self, name: str, path: str | Path, step: int) -> None:
        self._append(self.run_dir / IMAGES_FILE, {"step": step, "name": name, "path": str(path)})

    def close(self) -> None:
        """Nothing is held open."""

    @staticmethod
    def _append(path: Path, record: Mapping[str, Any]) -> None:
        with path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
