"""``benchmarks/push_latency.py`` at its smallest: the tiny model, the transformers engine, one repetition.

Speed is not asserted (the machine is shared); what is measured (the collector's push, the raw
write of the same tensors, a decoding step) and the rows' shape (read by ``lmcollect bench``) are.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.push_latency import measure, rows_of
from lmcollect.cli.bench import normalize_row

pytestmark = pytest.mark.integration


def test_the_rows_of_a_tiny_transformers_engine(tiny_model_path: Path) -> None:
    measured = measure("transformers", "small", 1, path=str(tiny_model_path))
    assert measured["push_s"] > 0 and measured["raw_reload_s"] > 0 and measured["step_s"] > 0
    assert len(measured["samples_push"]) == len(measured["samples_raw"]) == 1
    rows = [normalize_row("push_latency", row) for row in rows_of(measured)]
    assert [row["metric"] for row in rows] == [
        "push s / (raw reload s + one decoding step s)",
        "median push latency seen by the collector, s",
    ]
    ratio = measured["push_s"] / (measured["raw_reload_s"] + measured["step_s"])
    assert rows[0]["value"] == round(ratio, 2) and rows[1]["target"] == "<= 0.15"
