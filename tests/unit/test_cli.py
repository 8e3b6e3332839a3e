"""The `lmcollect` command: help without heavy imports, and a tiny demo run."""
from __future__ import annotations

import subprocess
import sys

from lmcollect.cli.main import main


def test_help_imports_nothing_heavy() -> None:
    code = "import sys, lmcollect.cli.main as m; m.build_parser(); print(sorted({'torch', 'ray', 'transformers'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_demo_runs_on_the_tiny_model(tiny_model_path, capsys) -> None:
    assert main(["demo", "--model", str(tiny_model_path), "--num-envs", "2", "--num-batches", "1", "--max-new-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "collected 2 dialog turns" in out and "[user]" in out and "[assistant]" in out
