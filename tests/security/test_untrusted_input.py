"""Untrusted text and files are refused or scored, never a crash: model replies and config files.

Part of the security suite (issue "Closed by default"): each test feeds one attack and asserts the
refusal (or the harmless outcome) and that nothing else changed.
"""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from lmcollect.cli.main import main
from lmcollect.data.history import History
from lmcollect.envs import ChatEnv, GuessingGameTask, guessing_game_dataset
from lmcollect.envs.tasks.base import MAX_ANSWER_DIGITS, parse_model_int
from lmcollect.envs.tasks.tool_calc import ToolCalcTask, tool_calc_dataset
from lmcollect.collectors import LLMCollector
from lmcollect.data import keys
from lmcollect.data.turns import flatten_turns
from lmcollect.testing import ScriptedPolicy

HUGE = "9" * 10_000  # int() refuses strings of over 4300 digits


def test_parse_model_int_caps_digits_and_never_raises() -> None:
    assert parse_model_int("-" + "1" * MAX_ANSWER_DIGITS) == -int("1" * MAX_ANSWER_DIGITS)
    assert parse_model_int("1" * (MAX_ANSWER_DIGITS + 1)) is None
    assert parse_model_int(HUGE) is None


@pytest.mark.parametrize("reply", [f"My guess: {HUGE}", f"{HUGE} or 7"], ids=["huge_last", "huge_first"])
def test_a_ten_thousand_digit_guess_earns_the_invalid_reward_and_collection_goes_on(reply: str) -> None:
    env = ChatEnv(guessing_game_dataset(4, seed=0), task=GuessingGameTask(invalid_reward=-0.5), batch_size=2, max_turns=5, seed=0)
    collector = LLMCollector(env, policy=ScriptedPolicy(reply), dialog_turns_per_batch=4, total_dialog_turns=8)
    turns = [t for batch in collector for t in flatten_turns(batch)]
    assert len(turns) == 8
    rewards = {float(t.get(keys.NEXT_REWARD)) for t in turns}
    if reply.startswith("My"):
        assert rewards == {-0.5}  # no usable number: the invalid reward, the game goes on
    else:
        assert rewards <= {0.0, 1.0}  # the last number (7) is the guess


def test_a_ten_thousand_digit_tool_call_or_answer_is_answered_not_raised() -> None:
    task = ToolCalcTask(max_latency_s=0.0)
    row = tool_calc_dataset(1, seed=0)[0]
    state = task.start(row, random.Random(0))
    for reply, expected in [
        (f"CALC: {HUGE} * {HUGE}", f"at most {MAX_ANSWER_DIGITS} digits"),
        (f"ANSWER: {HUGE}", "Wrong answer"),
    ]:
        history = History.from_text(row["prompt"]).append("assistant", reply)
        answer = task._reply(state, history)[0]
        assert answer.reward == 0.0 and not answer.done and expected in answer.env_message


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_a_non_finite_number_in_a_config_file_is_refused(tmp_path: Path, value: str, capsys) -> None:
    path = tmp_path / "run.toml"
    path.write_text(f"lr = {value}\n", encoding="utf-8")
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--config", str(path), "--print-config"])
    assert exc.value.code == 2
    assert "lr must be a finite number" in capsys.readouterr().err


def test_a_non_finite_flag_is_refused_naming_it(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["collect", "--task", "arithmetic", "--num-turns", "4", "--cpus-per-collector", "nan", "--print-config"])
    assert exc.value.code == 2
    assert "--cpus-per-collector must be positive, got nan" in capsys.readouterr().err


# ---------------------------------------------------------------------- attribute paths (cascade_execute)
@pytest.mark.parametrize(
    "path",
    [
        "cascade_execute.__globals__",
        "__class__.__init__",
        "policy.__dict__",
        "_halt",
        "_receiver_schemes['policy']._store",
        "__import__('os').system('true')",
    ],
)
def test_a_path_through_dunders_or_private_names_is_refused_before_any_lookup(path: str) -> None:
    collector = LLMCollector(ChatEnv(guessing_game_dataset(2, seed=0), batch_size=1, seed=0), policy=ScriptedPolicy("7"), dialog_turns_per_batch=1)
    touched: list[str] = []
    collector._receiver_schemes["policy"] = type("Scheme", (), {"__getattr__": lambda self, name: touched.append(name)})()
    with pytest.raises(ValueError, match="private attribute|cannot parse"):
        collector.cascade_execute(path)
    assert touched == []  # refused while parsing: nothing was looked up, nothing ran


def test_the_documented_private_path_still_works() -> None:
    collector = LLMCollector(ChatEnv(guessing_game_dataset(2, seed=0), batch_size=1, seed=0), policy=ScriptedPolicy("7"), dialog_turns_per_batch=1)
    scheme = type("Scheme", (), {"_set_dist_connection_info": lambda self, info, worker_idx=0: (info, worker_idx)})()
    collector._receiver_schemes["policy"] = scheme
    assert collector.cascade_execute("_receiver_schemes['policy']._set_dist_connection_info", {"a": 1}, worker_idx=2) == ({"a": 1}, 2)
