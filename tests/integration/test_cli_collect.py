"""`lmcollect collect` end to end on the session's Ray cluster; the files are read back with pandas."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pandas as pd
import pytest

from lmcollect.cli.main import main
from lmcollect.cli.rollouts import COLUMNS

pytestmark = pytest.mark.integration


def _collect(tiny_model_path: Path, output: Path, *args: str) -> pd.DataFrame:
    argv = ["collect", "--model", str(tiny_model_path), "--max-new-tokens", "4", "--cpus-per-collector", "0.5",
            "--output", str(output), "--no-progress", *args]
    assert main(argv) == 0
    return pd.read_parquet(output) if output.suffix == ".parquet" else pd.read_json(output, lines=True, dtype=False)


def test_collect_two_collectors_to_parquet(ray_cluster, tiny_model_path: Path, tmp_path: Path, capsys) -> None:
    output = tmp_path / "out" / "turns.parquet"
    df = _collect(tiny_model_path, output, "--task", "comparison", "--num-turns", "16", "--num-envs", "4",
                  "--group-size", "2", "--num-collectors", "2")
    assert list(df.columns) == list(COLUMNS) and len(df) == 16
    assert df["traj_id"].nunique() == 16 and (df["traj_id"] // 2**32).nunique() == 2  # worker i numbers from i << 32
    assert df["done"].all() and df["policy_version"].eq(0).all() and df["reward"].isin([0.0, 1.0]).all()
    assert (df["log_probs"].map(len) == df["tokens_response"].map(len)).all()
    assert df["prompt"].str.contains("Which is larger").all() and df["prompt"].str.endswith("<|im_start|>assistant\n").all()
    out = capsys.readouterr().out
    assert "wrote 16 turns" in out and "library and Ray worker logs:" in out
    assert "Ray workers' output" in (tmp_path / "out" / "turns.parquet.log").read_text()  # library logs: beside the output
    if importlib.util.find_spec("datasets") is not None:  # optional: not a dependency of lmcollect
        import datasets

        assert datasets.load_dataset("parquet", data_files=str(output), split="train").num_rows == 16


def test_collect_a_prompt_file_to_jsonl(ray_cluster, tiny_model_path: Path, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Say {w}."}) + "\n" for w in ("yes", "no", "maybe")), encoding="utf-8")
    df = _collect(tiny_model_path, tmp_path / "turns.jsonl", "--prompts", str(prompts), "--num-turns", "6",
                  "--num-envs", "3", "--temperature", "0")
    assert len(df) == 6 and df["reward"].eq(0.0).all()  # no --task: nothing scores the answers
    assert {p.split("user\n")[1].split("<|im_end|>")[0] for p in df["prompt"]} == {"Say yes.", "Say no.", "Say maybe."}


def test_collect_a_multi_turn_task_writes_whole_dialogs(ray_cluster, tiny_model_path: Path, tmp_path: Path) -> None:
    df = _collect(tiny_model_path, tmp_path / "games.parquet", "--task", "guessing", "--num-turns", "10", "--num-envs", "2")
    last_steps = df.groupby("traj_id")["step"].transform("max")
    assert df.loc[df["step"] == last_steps, "done"].all() and not df.loc[df["step"] < last_steps, "done"].any()
    assert (df.groupby("traj_id")["step"].apply(sorted).map(lambda s: s == list(range(len(s))))).all()
