"""`lmcollect demo --task agent` and `examples/agent_calculator.py` at their smallest (no Ray: both run in process)."""
from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import pytest

from lmcollect.cli.main import main

ROOT = Path(__file__).resolve().parents[2]


def test_the_agent_demo_trains_on_agent_runs_and_pushes_every_step(tiny_model_path: Path, tmp_path: Path, capsys) -> None:
    argv = ["demo", "--task", "agent", "--model", str(tiny_model_path), "--max-steps", "2", "--warmup-steps", "2",
            "--num-eval-prompts", "4", "--prompts-per-batch", "1", "--group-size", "2", "--output-dir", str(tmp_path)]
    assert main(argv) == 0
    (run_dir,) = tmp_path.iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert summary["task"] == "agent" and summary["steps"] == 2 and not summary["interrupted"]
    assert [r["policy_version"] for r in records] == [2, 3]  # version 1: the warmed-up weights; a push per step
    assert set(summary["reward"]) == {"initial", "before_rl", "final"}
    agents = summary["agents"]
    assert agents["runs_finished"] >= 4 and agents["calls"] >= agents["runs_finished"] and agents["runs_failed"] == 0
    out = capsys.readouterr().out
    assert "supervised warm-up" in out and "after RL" in out and "agent runs finished / failed" in out
    cost = summary["push_cost"]  # each push's timeline as the continuous collector's engine recorded it
    assert cost["pushes"] == 3 and cost["load_s"] > 0 and cost["wait_s"] >= 0 and cost["kv_policy"] == "recompute"
    assert "push timeline" in out  # the summary table's row (rich wraps its label)


def test_the_agent_demo_refuses_what_it_does_not_run(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="2"):
        main(["demo", "--task", "agent", "--lora-rank", "4", "--output-dir", str(tmp_path)])


def test_the_calculator_example_collects_and_trains(tiny_model_path: Path, monkeypatch, capsys) -> None:
    script = ROOT / "examples" / "agent_calculator.py"
    monkeypatch.setattr(sys, "argv", [str(script), "--model", str(tiny_model_path), "--steps", "2",
                                      "--group-size", "2", "--questions", "1"])
    runpy.run_path(str(script), run_name="__main__")
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert len(lines) == 2 and "version 2" in lines[0] and "version 3" in lines[1]
