"""`lmcollect demo` end to end on the session's Ray cluster: a handful of steps, and Ctrl-C."""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from lmcollect.cli.main import main
from tests.processes import Child

pytestmark = pytest.mark.integration

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SMALL_RUN = [
    "--warmup-steps", "2", "--num-eval-prompts", "8", "--prompts-per-batch", "2", "--group-size", "4",
    "--turns-per-step", "16", "--cpus-per-collector", "0.25",
]


def _run_dir(output_dir: Path) -> Path:
    (run_dir,) = output_dir.iterdir()
    return run_dir


def test_demo_trains_pushes_every_step_and_shuts_every_collector_down(ray_cluster, tiny_model_path: Path, tmp_path: Path, capsys) -> None:
    """Also: TensorBoard gets the metrics and the plot, and progress goes to a non-terminal as plain lines."""
    argv = ["demo", "--model", str(tiny_model_path), "--max-steps", "3", "--output-dir", str(tmp_path), "--logger", "tensorboard", *SMALL_RUN]
    assert main(argv) == 0
    run_dir = _run_dir(tmp_path)
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert summary["steps"] == 3 and summary["interrupted"] is False
    # version 1 is the warmed-up weights; every step pushes once more to every collector
    assert [r["policy_version"] for r in records] == [2, 3, 4]
    assert summary["collectors"] == [{"policy_version": 4, "shut_down": True}] * 2
    assert all(0 <= r["staleness/mean"] <= 2 and r["timing/weight_sync/push_s"] > 0 for r in records)
    assert records[-1]["collect/turns"] >= 3 * 16
    assert summary["weight_push_bytes"]["kind"] == "full" and summary["config"]["lora_rank"] == 0
    assert set(summary["reward"]) == {"initial", "before_rl", "final"}
    # --dynamic-sampling auto: on only if the warmed-up policy solves some prompts and not all
    sampling = summary["dynamic_sampling"]
    assert sampling["mode"] == "auto" and sampling["on"] == (0.05 <= summary["reward"]["before_rl"] <= 0.95)
    assert (run_dir / "training.png").read_bytes()[:8] == PNG_MAGIC
    out = capsys.readouterr().out
    assert "dynamic sampling" in out
    assert "supervised warm-up" in out and "after RL" in out and "collectors shut down" in out
    # a lockstep collector over a torch module has no engine recording pushes: its timeline reads "-"
    assert summary["push_cost"]["pushes"] == 0 and "push timeline" in out
    # library chatter goes to the run's log file (what reaches the terminal: the Ctrl-C test, its own driver)
    assert "library and Ray worker logs:" in out and (run_dir / "libraries.log").exists()
    assert "step 3/3  " in out and "mean reward" in out  # stdout is not a terminal: plain progress lines
    assert summary["files"]["logger"] == "tensorboard"
    _check_tensorboard(run_dir / "tensorboard", records)
    # the HTML report of the last training steps' turns
    assert summary["files"]["report"] == "rollouts.html"
    page = (run_dir / "rollouts.html").read_text(encoding="utf-8")
    assert 'id="rollout-data"' in page and "last 3 training steps" in page
    assert "rollouts of the last training steps" in out and "(open it in a browser)" in out


def test_demo_with_a_lora_rank_pushes_only_the_adapter(ray_cluster, tiny_model_path: Path, tmp_path: Path, capsys) -> None:
    """--lora-rank: version 1 is the warmed-up base in full, every training step pushes the adapter alone."""
    pytest.importorskip("peft", reason="--lora-rank needs the lora extra: pip install 'lmcollect[lora]'")
    argv = ["demo", "--model", str(tiny_model_path), "--max-steps", "3", "--output-dir", str(tmp_path), "--no-progress",
            "--lora-rank", "4", *SMALL_RUN]
    assert main(argv) == 0
    run_dir = _run_dir(tmp_path)
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert summary["steps"] == 3 and summary["interrupted"] is False and summary["config"]["lora_rank"] == 4
    assert [r["policy_version"] for r in records] == [2, 3, 4]
    assert summary["collectors"] == [{"policy_version": 4, "shut_down": True}] * 2
    adapter_bytes = _lora_bytes(tiny_model_path, rank=4)
    pushed = summary["weight_push_bytes"]
    assert pushed["kind"] == "lora" and pushed["per_step"] == adapter_bytes
    assert [r["weight_sync/push_bytes"] for r in records] == [adapter_bytes] * 3
    assert pushed["initial"] > 20 * adapter_bytes  # the full push of the warmed-up base, once
    reward = summary["reward"]
    # as in the full run above, 3 steps after a 2-step warm-up teach nothing (both are 0 here); that LoRA
    # learns as full fine-tuning does is checked by `lmcollect demo --lora-rank 8` at the default settings
    assert reward["final"] >= reward["before_rl"]
    out = capsys.readouterr().out
    assert "RL trains a LoRA adapter of rank 4" in out and "(LoRA rank 4)" in out and "collectors shut down" in out


def _lora_bytes(model_path: Path, *, rank: int) -> int:
    """Bytes of a float32 rank-``rank`` adapter on every linear layer of the decoder blocks: A (rank x in)
    and B (out x rank) of each."""
    import torch

    from lmcollect.models import load_model_and_tokenizer

    model, _ = load_model_and_tokenizer(model_path)
    linears = [m for name, m in model.named_modules() if ".layers." in name and isinstance(m, torch.nn.Linear)]
    assert len(linears) == 7 * model.config.num_hidden_layers  # q k v o, gate up down
    return sum(4 * rank * (m.in_features + m.out_features) for m in linears)


def _check_tensorboard(log_dir: Path, records: list[dict]) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"images": 0, "scalars": 0})
    events.Reload()
    for key in ("reward/mean", "collect/turns_per_s", "timing/weight_sync/push_s", "staleness/mean"):
        assert [(e.step, e.value) for e in events.Scalars(key)] == [(r["step"], pytest.approx(r[key])) for r in records]
    assert [image.step for image in events.Images("training")] == [len(records)]


def test_ctrl_c_shuts_the_collectors_down_and_keeps_the_run_folder(ray_cluster, tiny_model_path: Path, tmp_path: Path) -> None:
    address = ray_cluster.get_runtime_context().gcs_address  # attach: no second cluster to start
    argv = [*_lmcollect(), "demo", "--address", address, "--model", str(tiny_model_path), "--max-steps", "10000",
            "--max-train-s", "600", "--output-dir", str(tmp_path), "--no-progress", "--logger", "wandb", *SMALL_RUN]
    env = {**os.environ, "WANDB_SILENT": "true"}
    env.pop("WANDB_MODE", None)  # offline by default
    with Child(argv, tmp_path / "demo.log", env=env) as child:
        # budgets for a loaded 2-core machine: start-up, warm-up and a step; then the shutdown
        metrics = _wait_for_steps(tmp_path, child, num_steps=1, timeout_s=300)
        interrupted = time.monotonic()
        child.proc.send_signal(signal.SIGINT)
        returncode = child.wait(timeout_s=180, what="the demo after Ctrl-C")
        output = child.output(last_chars=100_000)
    assert returncode == 130, f"exit status {returncode} {time.monotonic() - interrupted:.0f} s after Ctrl-C:\n{output}"
    summary = json.loads((metrics.parent / "summary.json").read_text())
    assert summary["interrupted"] is True and summary["steps"] >= 1
    assert len(summary["collectors"]) == 2 and all(c["shut_down"] for c in summary["collectors"])
    assert len(metrics.read_text().splitlines()) == summary["steps"]  # every finished step was written
    assert "interrupted" in output
    # the terminal shows no library chatter: no progress bars, no Ray or worker lines (they are in the log file)
    for noise in ("Loading weights", "_RayCollectorWorker pid=", "Token authentication", "INFO worker.py"):
        assert noise not in output, f"{noise!r} reached the terminal:\n{output}"
    assert "Ray workers' output" in (metrics.parent / "libraries.log").read_text()
    # the W&B run was closed: offline, in the run folder, with the finished steps in it
    assert summary["files"]["logger"] == "wandb"
    (wandb_run,) = (metrics.parent / "wandb").glob("offline-run-*")
    assert list(wandb_run.glob("*.wandb")) and list(wandb_run.glob("files/media/images/training_*.png"))


def _lmcollect() -> list[str]:
    return [sys.executable, "-m", "lmcollect.cli.main"]


def _wait_for_steps(output_dir: Path, child: Child, *, num_steps: int, timeout_s: float) -> Path:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if child.proc.poll() is not None:
            raise AssertionError(f"the demo exited early ({child.proc.returncode}):\n{child.output()}")
        for metrics in output_dir.glob("*/metrics.jsonl"):
            if len(metrics.read_text().splitlines()) >= num_steps:
                return metrics
        time.sleep(0.2)
    raise AssertionError(f"no {num_steps} training steps within {timeout_s} s; the demo printed:\n{child.output()}")
