"""One way to name an environment: 'ecosystem:name' in make_env, named_task, --env and TOML configs."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from lmcollect.cli.builders import EnvFactory, resolve_task
from lmcollect.cli.configs import CollectConfig, DemoConfig, UsageError, read_config_file
from lmcollect.cli.main import main
from lmcollect.envs import ChatEnv, get_shipped_task, make_env, named_task, register_ecosystem, registered_envs
from lmcollect.envs.registry import _ECOSYSTEMS, split_settings
from lmcollect.envs.tasks.shipped import ShippedTask


def _error(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_env_names_a_shipped_task_or_an_ecosystem_env_and_replaces_task() -> None:
    assert CollectConfig(env="lmcollect:guessing").env == "lmcollect:guessing"
    assert DemoConfig(env="reasoning-gym:basic_arithmetic").task == "comparison"  # --env wins; --task is left unset
    assert named_task("lmcollect:arithmetic") is named_task("arithmetic") is get_shipped_task("arithmetic")
    assert "reasoning-gym:*" in registered_envs()


def test_bad_env_names_exit_2_with_the_fix(capsys) -> None:
    assert "--env is 'ecosystem:name'" in _error(["collect", "--env", "arithmetic"], capsys)
    assert "pass one of them" in _error(["collect", "--env", "lmcollect:guessing", "--task", "arithmetic"], capsys)
    assert "pass one of them" in _error(["demo", "--env", "lmcollect:addition", "--task", "arithmetic"], capsys)
    with pytest.raises(UsageError, match="--env nope:x: 'nope:x' names no env .* such ecosystems: lmcollect"):
        resolve_task("nope:x", flag="--env")


def test_a_toml_config_names_the_env_the_same_way(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text('env = "reasoning-gym:leg_counting"\n', encoding="utf-8")
    assert read_config_file(path, CollectConfig, command="collect") == {"env": "reasoning-gym:leg_counting"}
    assert read_config_file(path, DemoConfig, command="demo") == {"env": "reasoning-gym:leg_counting"}


def test_an_ecosystem_registered_with_task_runs_in_the_commands_by_its_env_name() -> None:
    """An ecosystem that gives prompt rows and a scoring task: named_task, make_env and the commands'
    env factory (what a collector actor builds) all take its 'ecosystem:name'."""
    shipped = get_shipped_task("addition")

    def recipe(name: str) -> ShippedTask:
        return ShippedTask(
            name=f"test-eco:{name}", description="addition, renamed", make_rows=shipped.make_rows,
            make_task=shipped.make_task,
        )

    try:
        register_ecosystem("test-eco", task=recipe)
        task = resolve_task("test-eco:sums", flag="--env")
        assert task.name == "test-eco:sums"
        env = EnvFactory(task_name=task.name, rows=task.make_rows(8, seed=0), num_envs=4, repeats=2, seed=0)()
        assert isinstance(env, ChatEnv) and tuple(env.batch_size) == (4,) and env.group_size == 2
        assert "test-eco:*" in registered_envs()
    finally:
        _ECOSYSTEMS.pop("test-eco", None)


def test_a_name_carries_the_envs_settings_after_a_question_mark() -> None:
    """'ecosystem:name?key=value&...': values read as JSON where they parse ('+' stays a plus); the
    task's name keeps them, so a collector actor that rebuilds it by name gets the same generator."""
    name = 'reasoning-gym:basic_arithmetic?min_terms=2&max_terms=2&max_digits=1&operators=["+"]'
    assert split_settings(name) == (
        "reasoning-gym:basic_arithmetic", {"min_terms": 2, "max_terms": 2, "max_digits": 1, "operators": ["+"]}
    )
    task = named_task(name)
    assert split_settings(task.name) == split_settings(name)
    rows = task.make_rows(16, seed=0)
    terms = [re.findall(r"-?\d+", row["question"]) for row in rows]
    assert all(len(t) == 2 and all(len(x.lstrip("-")) == 1 for x in t) for t in terms)  # two one-digit terms
    assert all(row["question"].count("+") == 1 for row in rows)  # and '+' between them
    env = make_env(name, batch_size=2, num_samples=8, seed=0)
    env.reset()
    assert all(len(re.findall(r"-?\d+", sample["question"])) == 2 for sample in env.current_samples)
    with pytest.raises(ValueError, match="key=value pairs joined by '&'"):
        named_task("reasoning-gym:basic_arithmetic?max_terms")
    with pytest.raises(ValueError, match="shipped tasks take no settings"):
        named_task("lmcollect:arithmetic?max_terms=2")
