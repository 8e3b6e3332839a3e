"""`lmcollect <command> --config FILE` and `--print-config`: TOML files with the flags' fields, flags winning."""
from __future__ import annotations

import dataclasses
import re
import tomllib
from pathlib import Path

import pytest

from lmcollect.cli.configs import CollectConfig, DemoConfig, UsageError, config_to_toml, read_config_file
from lmcollect.cli.main import COMMANDS, _field_docs, main

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "demo.toml"

# fields a command needs set (check-logprobs and view need their input file)
REQUIRED = {"check-logprobs": {"rollouts": "rollouts.jsonl"}, "view": {"rollouts": "rollouts.jsonl"}}


def _flags(values: dict) -> list[str]:
    return [item for name, value in values.items() for item in ("--" + name.replace("_", "-"), str(value))]


def _toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.toml"
    path.write_text(text, encoding="utf-8")
    return path


def _printed(argv: list[str], capsys) -> dict:
    assert main(argv) == 0
    return tomllib.loads(capsys.readouterr().out)


def _error(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_file_values_are_used_and_flags_override_them(tmp_path: Path, capsys) -> None:
    path = _toml(tmp_path, 'max_steps = 10\nlr = 0.01\ntask = "addition"\nprogress = false\n')
    config = _printed(["demo", "--config", str(path), "--print-config"], capsys)
    assert (config["max_steps"], config["lr"], config["task"], config["progress"]) == (10, 0.01, "addition", False)
    assert config["group_size"] == DemoConfig().group_size  # not in the file: the default
    # a flag wins over the file, also when it repeats the built-in default
    config = _printed(["demo", "--config", str(path), "--max-steps", "400", "--progress", "--print-config"], capsys)
    assert (config["max_steps"], config["progress"], config["lr"]) == (400, True, 0.01)


def test_the_flag_spelling_is_accepted_and_ints_fill_float_fields(tmp_path: Path, capsys) -> None:
    path = _toml(tmp_path, "max-train-s = 30\ncpus-per-collector = 1\n")
    config = _printed(["demo", "--config", str(path), "--print-config"], capsys)
    assert config["max_train_s"] == 30.0 and isinstance(config["max_train_s"], float)
    assert config["cpus_per_collector"] == 1.0


def test_unknown_keys_name_the_key_and_the_valid_ones(tmp_path: Path, capsys) -> None:
    err = _error(["demo", "--config", str(_toml(tmp_path, "max_step = 3\n"))], capsys)
    assert "unknown key 'max_step' for `lmcollect demo`" in err
    assert "valid keys: address, model, backend" in err and "max_steps" in err
    # a key of another command is unknown too
    err = _error(["collect", "--config", str(_toml(tmp_path, "warmup_steps = 3\n"))], capsys)
    assert "unknown key 'warmup_steps' for `lmcollect collect`" in err and "num_turns" in err


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('max_steps = "ten"\n', 'max_steps must be an integer, got "ten"'),
        ("max_steps = 2.5\n", "max_steps must be an integer, got 2.5"),
        ("max_steps = true\n", "max_steps must be an integer, got true"),
        ('lr = "fast"\n', 'lr must be a number, got "fast"'),
        ("progress = 1\n", "progress must be true or false, got 1"),
        ("model = 3\n", "model must be a quoted string, got 3"),
        ('backend = "tpu"\n', 'backend must be one of "transformers", "vllm", got "tpu"'),
        ('logger = "mlflow"\n', 'logger must be one of "jsonl", "tensorboard", "wandb", got "mlflow"'),
        ("[warmup]\nsteps = 3\n", "unknown key 'warmup'"),
        ("max_steps = [1, 2]\n", "max_steps must be an integer, got an array"),
        ("max_steps = 3\nmax-steps = 4\n", "'max_steps' is set twice"),
        ("max_steps = \n", "not valid TOML"),
        ("group_size = 1\n", "--group-size must be >= 2"),  # the config's own checks run on file values
    ],
)
def test_bad_values_name_the_key_and_what_to_write(tmp_path: Path, capsys, text: str, message: str) -> None:
    path = _toml(tmp_path, text)
    err = _error(["demo", "--config", str(path)], capsys)
    assert message in err
    if "group-size" not in message:
        assert f"--config {path}" in err


def test_a_missing_config_file_is_reported(tmp_path: Path, capsys) -> None:
    assert f"--config {tmp_path / 'nope.toml'}: no such file" in _error(["demo", "--config", str(tmp_path / "nope.toml")], capsys)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_print_config_reads_back_to_the_same_config(tmp_path: Path, capsys, command: str) -> None:
    """Every command built from a config dataclass takes --config and --print-config."""
    config_cls, _ = COMMANDS[command]
    required = REQUIRED.get(command, {})
    assert main([command, *_flags(required), "--print-config"]) == 0
    printed = capsys.readouterr().out
    path = _toml(tmp_path, printed)
    values = read_config_file(path, config_cls, command=command)
    default = config_cls(**required)
    assert config_cls(**values) == default
    # every field is in the file, under its help text; unset (None) fields are commented out
    for field in dataclasses.fields(config_cls):
        value = getattr(default, field.name)
        assert (f"# {field.name} =" if value is None else f"\n{field.name} = ") in printed, field.name
    assert printed.startswith(f"# lmcollect {command}: ")


def test_print_config_runs_nothing(tmp_path: Path, capsys) -> None:
    config = _printed(["collect", "--model", str(tmp_path / "missing"), "--print-config"], capsys)
    assert config["model"] == str(tmp_path / "missing")  # not checked: nothing ran


def test_toml_strings_round_trip_escapes(tmp_path: Path) -> None:
    config = CollectConfig(prompts='dir with "quotes"\\and\tbackslash/ü.jsonl', output="out.jsonl")
    path = _toml(tmp_path, config_to_toml(config, command="collect", docs=_field_docs(CollectConfig)))
    assert CollectConfig(**read_config_file(path, CollectConfig, command="collect")) == config


def test_the_shipped_demo_example_is_the_demo_defaults() -> None:
    """examples/demo.toml (`lmcollect demo --print-config > examples/demo.toml`) sets every field to its default."""
    values = read_config_file(EXAMPLE, DemoConfig, command="demo")
    assert DemoConfig(**values) == DemoConfig()
    text = EXAMPLE.read_text(encoding="utf-8")
    missing = [f.name for f in dataclasses.fields(DemoConfig) if f"{f.name} =" not in text]
    assert not missing, f"examples/demo.toml lacks {missing}: regenerate it with lmcollect demo --print-config"


def test_read_config_file_raises_usage_errors(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="unknown key 'nope'"):
        read_config_file(_toml(tmp_path, "nope = 1\n"), DemoConfig, command="demo")


def test_the_reasoning_gym_example_names_a_generator_the_demo_trains_on() -> None:
    """examples/reasoning-gym.toml: its env resolves to a single-turn reasoning-gym task with answers."""
    from lmcollect.cli.demo import _single_turn_task

    values = read_config_file(EXAMPLE.parent / "reasoning-gym.toml", DemoConfig, command="demo")
    config = DemoConfig(**values)
    task = _single_turn_task(config.env, flag="--env")
    assert task.name == config.env and config.warmup_steps == 40
    rows = task.make_rows(4, seed=0)
    assert all(re.search(r"if you have [12] \w+\?", row["question"]) for row in rows)
