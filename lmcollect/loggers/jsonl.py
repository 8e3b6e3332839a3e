"""JSON-lines logger: metrics.jsonl (one line per step) in the run folder, needing nothing installed."""

from __future__ import annotations

import json
import math
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
    ``config`` (if given) goes to ``config.json``. ``records`` holds what was logged, as given.

    Every line is strict JSON: a NaN or infinite float (also inside lists and dicts) is written as
    ``null``, since JSON has no ``NaN``/``Infinity`` and strict readers (``jq``, JavaScript's
    ``JSON.parse``, ``json.loads(line, parse_constant=...)`` that refuses them) would reject the line.
    """

    def __init__(self, run_dir: str | Path, *, config: Mapping[str, Any] | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        self.path.touch()
        self.records: list[dict[str, Any]] = []
        if config:
            (self.run_dir / CONFIG_FILE).write_text(
                json.dumps(finite_or_null(dict(config)), indent=2, default=str, allow_nan=False) + "\n",
                encoding="utf-8",
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
        line = json.dumps(finite_or_null(record), allow_nan=False)  # built before the file is touched
        with path.open("a", encoding="utf-8") as f:
            f.write(line + "\n")


def finite_or_null(value: Any) -> Any:
    """``value`` with every NaN or infinite float (in dicts, lists and tuples too) replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {key: finite_or_null(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [finite_or_null(item) for item in value]
    return value
