"""The CI soak: ``benchmarks/soak.py`` for 48 s with the same pass/fail rules as a long run.

Two collectors, a trainer pushing after every batch, replay-buffer sampling: no turn lost or
duplicated, the RSS floor of the trainer, collectors and buffer within 5% after the warm-up
(the lowest sample of the first third against that of the last third: one sample swings with
every training step, a leak raises the floor). Set
``LMCOLLECT_SKIP_SOAK=1`` to skip it locally (CI always runs it: .ci/run sets nothing).
"""
from __future__ import annotations

import os

import pytest

from benchmarks.soak import SoakConfig, format_report, run_soak

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.environ.get("LMCOLLECT_SKIP_SOAK") == "1", reason="LMCOLLECT_SKIP_SOAK=1"),
]


def test_short_soak_loses_nothing_and_keeps_memory_flat(ray_cluster, tiny_model_path) -> None:
    config = SoakConfig(minutes=0.8, warmup_s=20.0, sample_every_s=1.0, model_dir=str(tiny_model_path.parent))
    report = run_soak(config)
    print(format_report(report))  # shown with -s or on failure
    assert report["problems"] == [], format_report(report)
    turns = report["turns"]
    assert turns["collected"] == turns["written"] + turns["pending"] > 0
    assert report["pushes"]["count"] == report["train_steps"] > 0
