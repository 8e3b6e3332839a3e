"""Output files stay readable by strict parsers whatever the run logs (issue 42, item 13).

``metrics.jsonl`` is read by other tools (``jq``, JavaScript dashboards, ``json.loads`` with
``parse_constant`` refusing ``NaN``): a diverging loss must not turn a line into invalid JSON.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from lmcollect.loggers import JsonlLogger
from lmcollect.loggers.jsonl import CONFIG_FILE, METRICS_FILE


def strict_loads(line: str) -> object:
    """``json.loads`` as a strict reader does it: ``NaN``, ``Infinity`` and ``-Infinity`` are errors."""

    def refuse(constant: str) -> object:
        raise ValueError(f"not JSON: {constant}")

    return json.loads(line, parse_constant=refuse)


def test_nan_and_inf_metrics_are_written_as_null_and_every_line_is_strict_json(tmp_path: Path) -> None:
    log = JsonlLogger(tmp_path, config={"lr": 1e-5, "clip": math.inf})
    diverged = {
        "loss": math.nan, "kl": math.inf, "advantage_min": -math.inf, "grad_norm": np.float64("nan"),
        "per_group": [1.0, math.nan, {"inner": -math.inf}], "pair": (math.inf, 2), "reward": 0.5,
        "turns": 64, "name": "NaN",
    }  # fmt: skip
    log.log(diverged, step=1)
    log.log({"loss": 0.25}, step=2)
    lines = (tmp_path / METRICS_FILE).read_text(encoding="utf-8").splitlines()
    records = [strict_loads(line) for line in lines]
    assert records[0] == {
        "step": 1, "loss": None, "kl": None, "advantage_min": None, "grad_norm": None,
        "per_group": [1.0, None, {"inner": None}], "pair": [None, 2], "reward": 0.5, "turns": 64, "name": "NaN",
    }  # fmt: skip
    assert records[1] == {"step": 2, "loss": 0.25}
    assert strict_loads((tmp_path / CONFIG_FILE).read_text(encoding="utf-8")) == {"lr": 1e-5, "clip": None}
    assert math.isnan(log.records[0]["loss"])  # in memory: what was logged, as given
