"""The `lmcollect` command without Ray: parser, help, input errors, output files, report and bench pieces."""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lmcollect.cli.configs import BenchConfig, CollectConfig, DemoConfig
from lmcollect.cli.main import COMMANDS, _field_docs, build_parser, main
from lmcollect.data import keys

LMCOLLECT = [sys.executable, "-m", "lmcollect.cli.main"]


# ---------------------------------------------------------------------------------------- shape
def test_help_imports_nothing_heavy() -> None:
    code = "import sys, lmcollect.cli.main as m; m.build_parser(); print(sorted({'torch', 'ray', 'transformers', 'rich'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_help_lists_every_command() -> None:
    # fast because it imports nothing heavy (test above); no wall-clock bound on a shared machine
    out = subprocess.run([*LMCOLLECT, "--help"], capture_output=True, text=True, check=True, timeout=120)
    assert "demo" in out.stdout and "collect" in out.stdout and "bench" in out.stdout


def test_every_field_of_every_command_has_a_help_line() -> None:
    assert set(COMMANDS) == {"demo", "collect", "bench", "check-logprobs", "view"}
    for name, (config_cls, _) in COMMANDS.items():
        docs = _field_docs(config_cls)
        missing = [f.name for f in dataclasses.fields(config_cls) if not docs.get(f.name)]
        assert not missing, f"{name}: fields without a docstring: {missing}"


@pytest.mark.parametrize(("command", "flag"), [("demo", "--output-dir"), ("collect", "--output "), ("bench", "--output ")])
def test_subcommand_help(command: str, flag: str, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main([command, "--help"])
    assert exc.value.code == 0
    assert flag in capsys.readouterr().out


def test_flags_come_from_the_dataclass_with_types_and_choices() -> None:
    args = build_parser().parse_args(["demo", "--max-steps", "7", "--lr", "0.01", "--no-progress", "--backend", "vllm"])
    assert (args.max_steps, args.lr, args.progress, args.backend, args.model) == (7, 0.01, False, "vllm", None)


def test_task_help_names_the_shipped_tasks() -> None:
    from lmcollect.envs import SHIPPED_TASKS

    docs = _field_docs(CollectConfig)["task"]
    assert all(name in docs for name in SHIPPED_TASKS)


# ---------------------------------------------------------------------------------------- bad input
def _error(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_bad_flag_values_exit_2_with_the_flag_named(capsys) -> None:
    assert "--group-size must be >= 2" in _error(["demo", "--group-size", "1"], capsys)
    assert "--max-staleness must be >= 1" in _error(["demo", "--max-staleness", "0"], capsys)
    assert "invalid choice: 'tpu'" in _error(["collect", "--backend", "tpu"], capsys)
    assert "--output must end with .parquet or .jsonl" in _error(["collect", "--output", "x.csv"], capsys)
    assert "--num-envs (6) must be a multiple of --group-size (4)" in _error(["collect", "--num-envs", "6", "--group-size", "4"], capsys)


def test_collect_reports_a_missing_model_folder(tmp_path: Path, capsys) -> None:
    err = _error(["collect", "--model", str(tmp_path / "nowhere")], capsys)
    assert f"--model {tmp_path / 'nowhere'}: no such folder" in err
    assert "not a model folder (no config.json" in _error(["collect", "--model", str(tmp_path)], capsys)


def test_collect_reports_the_line_of_a_malformed_prompt_file(tmp_path: Path, capsys) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "What is 1 + 1?"}\n{"prompt": "broken\n', encoding="utf-8")
    err = _error(["collect", "--prompts", str(prompts)], capsys)
    assert f"{prompts}:2: malformed JSON line" in err
    prompts.write_text('{"prompt": "ok"}\n{"question": "no prompt key"}\n', encoding="utf-8")
    assert f"{prompts}:2: row has no 'prompt' key" in _error(["collect", "--prompts", str(prompts)], capsys)
    assert "no such file" in _error(["collect", "--prompts", str(tmp_path / "missing.jsonl")], capsys)


def test_collect_needs_answers_to_score_prompt_rows(tmp_path: Path, capsys) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "What is 1 + 1?", "answer": "2"}\n{"prompt": "What is 2 + 2?"}\n', encoding="utf-8")
    err = _error(["collect", "--prompts", str(prompts), "--task", "arithmetic"], capsys)
    assert "row 2 has no 'answer' for --task arithmetic" in err


def test_unknown_or_unsuitable_tasks(capsys) -> None:
    assert "unknown task 'chess'; shipped tasks: comparison" in _error(["collect", "--task", "chess"], capsys)
    assert "unknown task 'chess'" in _error(["demo", "--task", "chess"], capsys)
    assert "the demo trains on single-turn tasks" in _error(["demo", "--task", "guessing"], capsys)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed: --backend vllm runs")
def test_vllm_backend_without_vllm(capsys) -> None:
    assert "vLLM is not installed" in _error(["collect", "--backend", "vllm"], capsys)
    assert "vLLM is not installed" in _error(["demo", "--backend", "vllm"], capsys)


def test_bench_rejects_unknown_benchmarks(capsys) -> None:
    assert "unknown benchmark(s) ['nope']" in _error(["bench", "--only", "nope"], capsys)


# ---------------------------------------------------------------------------------------- collect output
def test_collected_turns_round_trip_through_parquet_and_jsonl(tmp_path: Path) -> None:
    import pandas as pd

    from lmcollect.cli.builders import EnvFactory
    from lmcollect.cli.rollouts import COLUMNS, batch_records, write_records
    from lmcollect.collectors import LLMCollector
    from lmcollect.envs import get_shipped_task
    from lmcollect.testing import ScriptedPolicy

    env = EnvFactory(task_name="comparison", rows=get_shipped_task("comparison").make_rows(16, seed=0), num_envs=4, repeats=2, seed=0)
    collector = LLMCollector(env, policy=ScriptedPolicy("9"), dialog_turns_per_batch=4, total_dialog_turns=8, track_policy_version=True)
    records = [record for batch in collector for record in batch_records(batch)]
    assert len(records) == 8
    for path, read in ((tmp_path / "t.parquet", pd.read_parquet), (tmp_path / "t.jsonl", lambda p: pd.read_json(p, lines=True, dtype=False))):
        df = read(write_records(records, path))
        assert list(df.columns) == list(COLUMNS) and len(df) == 8
        row = df.iloc[0]
        assert row["response"] == "9" and bool(row["done"])
        assert df["reward"].tolist() == [float(" 9 " in p or " 9?" in p) for p in df["prompt"]]  # 9 wins when asked
        assert "Which is larger" in row["prompt"]  # as the policy rendered it
        assert len(row["log_probs"]) == len(row["tokens_response"]) > 0 and len(row["tokens_prompt"]) > 0
        assert df["policy_version"].tolist() == [0] * 8 and df["traj_id"].nunique() == 8
        assert df.groupby("prompt_id").size().tolist() == [2, 2, 2, 2]  # group size 2


# ---------------------------------------------------------------------------------------- report
def test_run_folder_metrics_summary_and_plot(tmp_path: Path) -> None:
    from lmcollect.cli.report import make_run_dir, plot_training, write_summary
    from lmcollect.loggers import JsonlLogger

    first, second = make_run_dir(tmp_path, "demo"), make_run_dir(tmp_path, "demo")
    assert first != second and first.is_dir() and second.is_dir()
    log = JsonlLogger(first)
    for step in range(1, 4):
        log.log({"reward/mean": step / 4, "collect/turns_per_s": 10.0, "timing/weight_sync/push_s": 0.01}, step=step)
    assert [json.loads(line)["step"] for line in (first / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    png = plot_training(log.records, first / "training.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot_training([], first / "none.png") is None
    assert json.loads(write_summary(first, {"interrupted": True}).read_text()) == {"interrupted": True}


def test_training_status_table_shows_the_six_metrics() -> None:
    from rich.console import Console

    from lmcollect.cli.progress import training_status

    console = Console(width=100, record=True)
    console.print(training_status({"collect/turns": 640, "reward/mean": 0.5, "policy_version": 11, "collect/turns_per_s": 99.0,
                                   "timing/weight_sync/push_s": 0.02, "staleness/mean": 1.25}))
    text = console.export_text()
    for expected in ("turns", "mean reward", "version", "turns/s", "push s", "staleness", "640", "0.500", "11", "0.020", "1.25"):
        assert expected in text


# ---------------------------------------------------------------------------------------- bench
def test_bench_rows_share_one_shape() -> None:
    from lmcollect.cli.bench import markdown_table, normalize_row

    collect = normalize_row("collect", {"row": "LLMCollector small", "metric": "turns/s vs raw generate", "value": 0.97, "target": ">= 0.95", "met": True})
    sync = normalize_row("weight_sync", {"row": "views", "gb": 0.25, "median_s": 0.1, "s_per_gb": 0.4, "x_memcpy": 3.5})
    for row in (collect, sync):
        assert {"benchmark", "row", "metric", "value", "target", "met"} <= set(row)
    assert sync["value"] == 3.5 and sync["metric"] == "push s / memcpy s (0.400 s/GB)"
    # rows without a memcpy ratio or a per-GB figure (e.g. the delta encodings) keep their shape too
    odd = normalize_row("weight_sync", {"row": "delta encoding", "gb": 0.1, "s_per_gb": None, "x_memcpy": 1.2})
    assert odd["metric"] == "push s / memcpy s" and odd["value"] == 1.2
    table = markdown_table({"date": "2026-01-01", "machine": "x86_64 2 CPU cores", "quick": True, "rows": [collect, sync]})
    assert "2026-01-01" in table and "| collect | LLMCollector small | turns/s vs raw generate | 0.970 | >= 0.95 | True |" in table


def test_bench_reads_the_json_line_of_a_script_without_run(tmp_path: Path) -> None:
    from lmcollect.cli.bench import _json_of_main, _load_path

    script = tmp_path / "fake_bench.py"
    script.write_text(
        "import json, sys\n"
        "def main():\n"
        "    print('a human table')\n"
        "    print(json.dumps({'rows': [{'row': 'r', 'argv': sys.argv[1:]}]}))\n",
        encoding="utf-8",
    )
    assert _json_of_main(_load_path(script), ["--quick"]) == {"rows": [{"row": "r", "argv": ["--quick"]}]}


def test_bench_smoke_runs_the_collect_benchmark(tmp_path: Path, capsys) -> None:
    output = tmp_path / "bench.json"
    argv = ["bench", "--only", "collect", "--sizes", "tiny", "--rows", "local", "--batch-size", "2", "--max-new-tokens", "4", "--output", str(output)]
    assert main(argv) == 0
    report = json.loads(output.read_text())
    assert report["date"] and "CPU cores" in report["machine"]
    assert [r["row"] for r in report["rows"]] == ["LLMCollector tiny"] and report["rows"][0]["value"] > 0
    assert "LLMCollector tiny" in output.with_suffix(".md").read_text()
    out = capsys.readouterr().out
    assert "LLMCollector tiny" in out and "library and Ray worker logs:" in out
    assert (tmp_path / "bench-libraries.log").exists()


def test_configs_are_keyword_only_dataclasses() -> None:
    for config_cls in (DemoConfig, CollectConfig, BenchConfig):
        with pytest.raises(TypeError):
            config_cls(1)  # type: ignore[misc]


# ---------------------------------------------------------------------------------------- background collection
def _local_collector(buffer, respond) -> object:
    from lmcollect.cli.builders import EnvFactory
    from lmcollect.collectors import LLMCollector
    from lmcollect.envs import get_shipped_task
    from lmcollect.testing import ScriptedPolicy

    env = EnvFactory(task_name="comparison", rows=get_shipped_task("comparison").make_rows(16, seed=0), num_envs=2, repeats=2, seed=0)
    return LLMCollector(env, policy=ScriptedPolicy(respond), dialog_turns_per_batch=2, replay_buffer=buffer)


@pytest.mark.parametrize("backend", ["transformers", "vllm"])
def test_background_collection_fills_the_buffer_until_stopped(backend: str) -> None:
    """Every backend collects in the collectors' own background threads (start())."""
    from lmcollect.buffers import ReplayBuffer
    from lmcollect.cli.collection import background_collection

    buffer = ReplayBuffer(capacity=1000)
    collectors = [_local_collector(buffer, "9"), _local_collector(buffer, "8")]
    collection = background_collection(collectors, backend)
    collection.start()
    deadline = time.monotonic() + 30
    while buffer.write_count < 8 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert collection.is_running() and buffer.write_count >= 8
    collection.stop()
    for collector in collectors:
        collector.shutdown()
    assert not collection.is_running()


def test_background_collection_reports_a_failed_collector() -> None:
    from lmcollect.buffers import ReplayBuffer
    from lmcollect.cli.collection import background_collection

    def respond(history) -> str:
        raise ValueError("engine exploded")

    collection = background_collection([_local_collector(ReplayBuffer(capacity=10), respond)], "vllm")
    collection.start()
    deadline = time.monotonic() + 30
    with pytest.raises(RuntimeError, match="engine exploded"):
        while time.monotonic() < deadline:
            collection.is_running()
            time.sleep(0.01)


def test_vllm_engine_and_actor_settings() -> None:
    from lmcollect.cli import vllm_backend

    assert vllm_backend.engine_kwargs(0.0) == {"kv_cache_memory_bytes": 1 << 30, "enforce_eager": True}
    assert vllm_backend.engine_kwargs(0.5) == {"gpu_memory_utilization": pytest.approx(0.425)}
    cpu, gpu = vllm_backend.remote_config(0.0), vllm_backend.remote_config(0.5)
    assert "max_concurrency" not in cpu and "num_gpus" not in cpu and gpu["num_gpus"] == 0.5
    assert cpu["runtime_env"]["env_vars"] == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


# ---------------------------------------------------------------------------------------- progress without a terminal
def _record(step: int) -> dict[str, float]:
    return {"step": step, "collect/turns": 64 * step, "reward/mean": 0.5, "policy_version": step + 1}


def test_progress_is_live_on_a_terminal_and_plain_lines_otherwise() -> None:
    import io

    from rich.console import Console

    from lmcollect.cli.progress import PlainTrainingProgress, PlainTurnsProgress, TrainingProgress, training_progress, turns_progress

    piped = Console(file=io.StringIO())  # `make demo > log`: stdout is a file
    assert isinstance(training_progress(10, console=piped), PlainTrainingProgress)
    assert isinstance(turns_progress(piped), PlainTurnsProgress)
    terminal = Console(file=io.StringIO(), force_terminal=True)
    assert isinstance(training_progress(10, console=terminal), TrainingProgress)
    assert not isinstance(turns_progress(terminal), PlainTurnsProgress)


def test_no_progress_prints_nothing_and_logs_each_step_at_debug_level(caplog) -> None:
    import io
    import logging

    from rich.console import Console

    from lmcollect.cli.progress import PlainTrainingProgress, step_progress

    out = io.StringIO()
    log = logging.getLogger("lmcollect.cli.demo")
    with caplog.at_level(logging.DEBUG, logger=log.name), step_progress(
        10, console=Console(file=out), show=False, log=log
    ) as progress:
        progress.update(_record(3))
    assert out.getvalue() == ""
    assert [(r.name, r.levelno, r.getMessage()[:7]) for r in caplog.records] == [(log.name, logging.DEBUG, "step 3:")]
    assert isinstance(step_progress(10, console=Console(file=out), show=True, log=log), PlainTrainingProgress)


def test_plain_training_progress_prints_a_line_every_interval_and_the_last_step() -> None:
    import io

    from rich.console import Console

    from lmcollect.cli.progress import PlainTrainingProgress

    def lines(interval_s: float) -> list[str]:
        out = io.StringIO()
        with PlainTrainingProgress(400, console=Console(file=out, width=200), interval_s=interval_s) as progress:
            for step in range(1, 6):
                progress.update(_record(step))
        assert "\x1b[" not in out.getvalue()  # no terminal escape codes in a log file
        return out.getvalue().splitlines()

    assert [line.split("  ")[0] for line in lines(0.0)] == [f"step {i}/400" for i in range(1, 6)]
    (last,) = lines(3600.0)  # within one interval: only the last step, printed on the way out
    assert last.startswith("step 5/400  0 s  ") and "turns 320  mean reward 0.500  version 6" in last


def test_plain_turns_progress_reports_collect_and_honours_visible() -> None:
    import io

    from rich.console import Console

    from lmcollect.cli.progress import PlainTurnsProgress

    out = io.StringIO()
    with PlainTurnsProgress(Console(file=out, width=200), interval_s=0.0) as progress:
        bar = progress.add_task("collect", total=64, status="")
        progress.update(bar, completed=32, status="mean reward 0.250")
        progress.update(bar, completed=64, status="mean reward 0.500")
    assert out.getvalue().splitlines()[-1].startswith("collect 64/64  ")
    assert out.getvalue().splitlines()[-1].endswith("mean reward 0.500")
    quiet = io.StringIO()
    with PlainTurnsProgress(Console(file=quiet), interval_s=0.0) as progress:  # --no-progress
        bar = progress.add_task("collect", total=64, status="")
        progress.update(bar, visible=False)
        progress.update(bar, completed=64)
    assert quiet.getvalue() == ""


# ---------------------------------------------------------------------------------------- the demo's rollout report
def test_decoded_records_of_lean_turns_equal_the_collected_records(tiny_model_and_tokenizer) -> None:
    """The demo's buffer keeps only the learner's keys; the report's records decoded from their
    tokens are the records `lmcollect collect` writes for the full turns."""
    from lmcollect.cli.builders import EnvFactory
    from lmcollect.cli.report import decoded_turn_records
    from lmcollect.cli.rollouts import COLUMNS, batch_records
    from lmcollect.collectors import LLMCollector
    from lmcollect.envs import get_shipped_task
    from lmcollect.policies import TransformersPolicy
    from lmcollect.training.batch import LEARNER_KEYS, GroupAdvantage

    model, tokenizer = tiny_model_and_tokenizer
    env = EnvFactory(task_name="comparison", rows=get_shipped_task("comparison").make_rows(16, seed=0), num_envs=4, repeats=2, seed=0)
    policy = TransformersPolicy(model, tokenizer, max_new_tokens=6, seed=0)
    collector = LLMCollector(env, policy=policy, dialog_turns_per_batch=4, total_dialog_turns=4, track_policy_version=True)
    (batch,) = list(collector)
    expected = sorted(batch_records(batch), key=lambda r: r["traj_id"])
    lean = GroupAdvantage(group_size=2, keep_keys=LEARNER_KEYS)(batch)
    assert keys.TEXT_PROMPT not in lean.keys(include_nested=True)
    records = decoded_turn_records([lean, lean], tokenizer)  # a turn sampled twice is reported once
    assert sorted(records, key=lambda r: r["traj_id"]) == expected
    assert list(records[0]) == list(COLUMNS)


def test_plain_progress_lines_are_not_wrapped() -> None:
    """A log line stays one line however narrow the (non-terminal) console is."""
    import io

    from rich.console import Console

    from lmcollect.cli.progress import PlainTrainingProgress

    out = io.StringIO()
    record = {**_record(3), "collect/turns_per_s": 99.0, "timing/weight_sync/push_s": 0.02, "staleness/mean": 1.25}
    with PlainTrainingProgress(400, console=Console(file=out, width=40), interval_s=3600.0) as progress:
        progress.update(record)
    assert len(out.getvalue().splitlines()) == 1 and "staleness 1.25" in out.getvalue()


# ---------------------------------------------------------------------------------------- the demo's LoRA mode
def test_lora_rank_must_be_an_integer_of_at_least_zero(tmp_path: Path, capsys) -> None:
    assert "--lora-rank must be an integer >= 0" in _error(["demo", "--lora-rank", "-1"], capsys)
    assert "argument --lora-rank: invalid int value: '2.5'" in _error(["demo", "--lora-rank", "2.5"], capsys)
    assert "--lora-lr must be positive" in _error(["demo", "--lora-rank", "8", "--lora-lr", "0"], capsys)
    config = tmp_path / "demo.toml"
    config.write_text("lora_rank = 1.5\n")
    assert "lora_rank must be an integer, got 1.5" in _error(["demo", "--config", str(config)], capsys)
    for bad in (True, 2.0, "8"):
        with pytest.raises(ValueError, match="--lora-rank must be an integer >= 0"):
            DemoConfig(lora_rank=bad)  # type: ignore[arg-type]
    assert (DemoConfig().lora_rank, DemoConfig().rl_lr) == (0, DemoConfig().lr)  # full fine-tuning by default
    lora = DemoConfig(lora_rank=8, lora_lr=1e-3)
    assert lora.rl_lr == 1e-3


def test_lora_rank_from_a_config_file_and_print_config(tmp_path: Path, capsys) -> None:
    config = tmp_path / "demo.toml"
    config.write_text("lora_rank = 4\nlora-lr = 0.003\n")
    assert main(["demo", "--config", str(config), "--print-config"]) == 0
    out = capsys.readouterr().out
    assert "\nlora_rank = 4\n" in out and "\nlora_lr = 0.003\n" in out
    assert main(["demo", "--config", str(config), "--lora-rank", "0", "--print-config"]) == 0  # flags win
    assert "\nlora_rank = 0\n" in capsys.readouterr().out


def test_lora_without_peft_names_the_extra_to_install(monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "peft", None)  # `import peft` fails, find_spec("peft") is None
    err = _error(["demo", "--lora-rank", "8"], capsys)
    assert "--lora-rank 8: LoRA training needs peft: pip install 'lmcollect[lora]'" in err
    import torch

    from lmcollect.training.lora import wrap_lora

    with pytest.raises(ImportError, match=r"pip install 'lmcollect\[lora\]'"):
        wrap_lora(torch.nn.Sequential(torch.nn.Linear(4, 4)), 4)


def test_a_lora_learner_trains_only_the_adapter_and_the_wrapped_model_computes_with_it(tiny_model_path: Path) -> None:
    """What the demo's RL phase does with --lora-rank: the learner's optimiser holds the adapter's
    parameters only, the base stays as it was, and the model peft wrapped answers with the adapter
    (the demo evaluates it after RL); its push is the adapter of every decoder linear layer."""
    pytest.importorskip("peft", reason="needs the lora extra: pip install 'lmcollect[lora]'")
    import torch

    from lmcollect.envs import get_shipped_task
    from lmcollect.models import load_model_and_tokenizer
    from lmcollect.training.lora import count_parameters, wrap_lora
    from lmcollect.training.trainer import GRPOConfig, GRPOLearner
    from lmcollect.training.warmup import WarmupConfig, warm_up
    from lmcollect.weights.lora import lora_adapter

    model, tokenizer = load_model_and_tokenizer(tiny_model_path)  # its own copy: wrapping changes it in place
    base = {name: t.clone() for name, t in model.state_dict().items()}
    peft_model = wrap_lora(model, 4)
    learner = GRPOLearner(peft_model, GRPOConfig(lr=1e-3))
    lora_params = {name: p for name, p in peft_model.named_parameters() if "lora_" in name}
    assert {id(p) for p in learner.params} == {id(p) for p in lora_params.values()}
    assert count_parameters(peft_model)[0] == sum(p.numel() for p in lora_params.values())
    before = {name: p.detach().clone() for name, p in lora_params.items()}
    rows = get_shipped_task("comparison").make_rows(32, seed=0)
    warm_up(peft_model, tokenizer, rows, WarmupConfig(num_steps=2, batch_size=4, lr=1e-2))  # SFT: nonzero gradients
    assert any(not torch.equal(p, before[name]) for name, p in lora_params.items()), "the adapter did not train"
    for name, tensor in peft_model.get_base_model().state_dict().items():
        if "lora_" not in name:  # base_layer.weight is the base's weight, unchanged
            assert torch.equal(tensor, base[name.replace(".base_layer", "")]), name
    ids = torch.tensor([[5, 17, 230, 41]])
    with torch.no_grad():
        adapted = peft_model(input_ids=ids).logits
        torch.testing.assert_close(model(input_ids=ids).logits, adapted)  # the wrapped model has the adapter
        with peft_model.disable_adapter():
            assert not torch.allclose(peft_model(input_ids=ids).logits, adapted), "the adapter changed nothing"
    adapter = lora_adapter(peft_model)
    assert adapter.rank == 4 and len(adapter.layers) == 7 * model.config.num_hidden_layers  # q k v o gate up down


def test_bench_refuses_an_output_the_markdown_table_would_overwrite(capsys) -> None:
    assert "--output results.md names the JSON rows file" in _error(["bench", "--output", "results.md"], capsys)
    assert "use e.g. --output results.json" in _error(["bench", "--output", "results.md"], capsys)


def test_task_takes_a_shipped_task_by_its_name_or_its_env_registry_name() -> None:
    from lmcollect.cli.builders import EnvFactory, resolve_task
    from lmcollect.cli.configs import UsageError
    from lmcollect.envs import ChatEnv

    assert resolve_task("arithmetic") is resolve_task("lmcollect:arithmetic")
    with pytest.raises(UsageError, match="--task torchrl:GSM8KEnv: .* names no env that runs as prompts and a scoring"):
        resolve_task("torchrl:GSM8KEnv")  # a torchrl env runs through the Python API
    with pytest.raises(UsageError, match="--task lmcollect:nope: unknown task 'nope'; shipped tasks: comparison"):
        resolve_task("lmcollect:nope")
    rows = resolve_task("guessing").make_rows(4, seed=0)
    env = EnvFactory(task_name="guessing", rows=rows, num_envs=2, repeats=2, seed=0)()  # built by the registry
    assert isinstance(env, ChatEnv) and env.config.max_turns == 5 and tuple(env.batch_size) == (2,)
