"""A finite collector keeps its promise: it yields the turns ``total_dialog_turns`` counts, never fewer.

The rule (docs/collectors.md, "Turn budget"): a collector yields whole batches until it has yielded
``total_dialog_turns`` turns; steps mode yields exactly ``ceil(total / B) * B`` turns, last-steps
mode ``ceil(total / dialog_turns_per_batch)`` full batches, trajectories mode at least ``total``
(its last batch takes every trajectory completed by then). Every yielded (trajectory, step) is
unique, and a turn that was run is yielded unless its dialog was still under way at the end.
"""
from __future__ import annotations

import math
import time

import pytest

from lmcollect.buffers import ReplayBuffer
from lmcollect.collectors import ContinuousLLMCollector, LLMCollector
from lmcollect.data import keys
from lmcollect.data.turns import flatten_turns
from lmcollect.testing.scripted_engine import ByteTokenizer, ScriptedEngine, chat_script
from lmcollect.envs import ChatEnv, GuessingGameTask, MathAnswerReward, arithmetic_dataset, guessing_game_dataset
from lmcollect.envs.tasks.guessing import binary_search_player
from lmcollect.policies import SamplingConfig
from lmcollect.testing import ScriptedPolicy
from tests.factories import UnevenEnv, make_uneven_guessing_env

MODES = {
    "steps": {},
    "trajectories": {"yield_completed_trajectories": True},
    "last_steps": {"yield_only_last_steps": True},
}


def guessing_env(seed: int, batch_size: int = 1) -> ChatEnv:
    rows = guessing_game_dataset(32, seed=seed)
    return ChatEnv(rows, task=GuessingGameTask(), batch_size=batch_size, max_turns=5, seed=seed)


def arithmetic_env(seed: int, batch_size: int = 2) -> ChatEnv:
    return ChatEnv(arithmetic_dataset(64, seed=seed), reward_fn=MathAnswerReward(), batch_size=batch_size, seed=seed)


def ids_of(batches) -> list[tuple[int, int]]:
    return [(int(t.get(keys.TRAJ_IDS)), int(t.get(keys.STEP_COUNT))) for b in batches for t in flatten_turns(b)]


def expected_turns(mode: str, total: int, per_batch: int, num_slots: int) -> int | None:
    if mode == "steps":
        rows = math.ceil(per_batch / num_slots) * num_slots
        return math.ceil(total / rows) * rows
    if mode == "last_steps":
        return math.ceil(total / per_batch) * per_batch
    return None  # at least total


def check_budget(collector, batches, mode: str, total: int, per_batch: int, num_slots: int) -> None:
    ids = ids_of(batches)
    assert len(ids) == len(set(ids)), "a (trajectory, step) was yielded twice"
    expected = expected_turns(mode, total, per_batch, num_slots)
    if expected is None:
        assert len(ids) >= total, f"yielded {len(ids)} turns of the {total} promised"
        assert len(ids) < total + per_batch + 5 * num_slots, f"yielded {len(ids)}: far past the budget of {total}"
    else:
        assert len(ids) == expected, f"yielded {len(ids)} turns, the rule says {expected}"
    assert collector.turns_yielded == len(ids)
    if mode != "last_steps":  # every turn run was yielded, but those of dialogs still under way
        under_way = collector.turns_run - collector.turns_yielded
        assert under_way == collector.num_buffered_turns
        assert under_way <= (0 if mode == "steps" else 4 * num_slots)


@pytest.mark.parametrize("mode", list(MODES))
def test_one_env_yields_the_promised_turns(mode: str) -> None:
    collector = LLMCollector(
        guessing_env(0, batch_size=3), policy=ScriptedPolicy(binary_search_player),
        dialog_turns_per_batch=10, total_dialog_turns=37, **MODES[mode],
    )
    batches = list(collector)
    check_budget(collector, batches, mode, total=37, per_batch=10, num_slots=3)
    with pytest.raises(StopIteration, match="yielded total_dialog_turns=37"):
        collector.next()


@pytest.mark.parametrize("mode", list(MODES))
def test_eight_async_envs_with_uneven_step_times_yield_the_promised_turns(mode: str) -> None:
    envs = [make_uneven_guessing_env(seed) for seed in range(8)]
    collector = LLMCollector(
        envs, async_envs=True, policy=ScriptedPolicy(binary_search_player),
        dialog_turns_per_batch=16, total_dialog_turns=64, **MODES[mode],
    )
    batches = list(collector)
    collector.shutdown()
    check_budget(collector, batches, mode, total=64, per_batch=16, num_slots=8)


def test_async_env_threads_do_not_run_ahead_of_the_budget() -> None:
    # a fast env and a slow one: the fast thread may not spend turns that no batch will take
    envs = [UnevenEnv(arithmetic_env(0), seed=0, max_delay_s=0.0), UnevenEnv(arithmetic_env(1), seed=1, max_delay_s=0.03)]
    collector = LLMCollector(
        envs, async_envs=True, policy=ScriptedPolicy("#### 1"), dialog_turns_per_batch=8, total_dialog_turns=24
    )
    batches = list(collector)
    collector.shutdown()
    check_budget(collector, batches, "steps", total=24, per_batch=8, num_slots=4)
    assert collector.turns_run == 24, "the fast env ran turns past the last batch"


def test_the_old_eight_thread_case_keeps_all_256_turns() -> None:
    envs = [UnevenEnv(arithmetic_env(s), seed=s, max_delay_s=0.002 * s) for s in range(8)]
    collector = LLMCollector(
        envs, async_envs=True, policy=ScriptedPolicy("#### 1"), dialog_turns_per_batch=64, total_dialog_turns=256
    )
    batches = list(collector)
    collector.shutdown()
    check_budget(collector, batches, "steps", total=256, per_batch=64, num_slots=16)


@pytest.mark.parametrize("async_envs", [False, True], ids=["one_env", "async_envs"])
def test_start_writes_the_promised_turns_into_the_buffer(async_envs: bool) -> None:
    buffer = ReplayBuffer(capacity=1000)
    envs = [guessing_env(s, batch_size=2) for s in range(3)] if async_envs else guessing_env(0, batch_size=6)
    collector = LLMCollector(
        envs, async_envs=async_envs, policy=ScriptedPolicy(binary_search_player),
        dialog_turns_per_batch=12, total_dialog_turns=50, replay_buffer=buffer,
    )
    collector.start()
    collector._background.join(60)
    assert not collector.is_running(), "start() did not finish its budget within 60 s"
    collector.shutdown()
    assert len(buffer) == collector.turns_yielded == 60  # ceil(50 / 12) = 5 batches of 12


def test_a_restored_collector_counts_on_from_the_turns_it_yielded() -> None:
    def build() -> LLMCollector:
        return LLMCollector(
            guessing_env(0, batch_size=2), policy=ScriptedPolicy(binary_search_player),
            dialog_turns_per_batch=6, total_dialog_turns=30, yield_completed_trajectories=True,
        )

    first = build()
    before = [first.next(), first.next()]
    state = first.state_dict()
    second = build()
    second.load_state_dict(state)
    after = list(second)
    assert second.turns_yielded >= 30
    ids = ids_of(before + after)
    assert len(ids) == len(set(ids)) == second.turns_yielded


# ---------------------------------------------------------------------- the continuous collector
def scripted_guessing_collector(mode: str, **kwargs) -> ContinuousLLMCollector:
    return ContinuousLLMCollector(
        [guessing_env(seed) for seed in range(4)],
        engine=ScriptedEngine(script=chat_script(binary_search_player)),
        tokenizer=ByteTokenizer(),
        sampling=SamplingConfig(max_new_tokens=16),
        dialog_turns_per_batch=10,
        total_dialog_turns=37,
        **MODES[mode],
        **kwargs,
    )


@pytest.mark.parametrize("mode", list(MODES))
def test_the_continuous_collector_yields_the_promised_turns(mode: str) -> None:
    collector = scripted_guessing_collector(mode)
    try:
        batches = list(collector)
    finally:
        collector.shutdown()
    ids = ids_of(batches)
    assert len(ids) == len(set(ids))
    rows = sum(b.batch_size.numel() for b in batches)
    if mode == "trajectories":
        assert rows >= 37 and rows == collector.turns_run, "every turn run is yielded"
    else:
        assert rows == 40, f"yielded {rows}: ceil(37 / 10) whole batches of 10"
    if mode == "steps":
        assert collector.turns_run == 40


def test_the_continuous_collector_writes_the_promised_turns_with_start() -> None:
    buffer = ReplayBuffer(capacity=1000)
    collector = scripted_guessing_collector("trajectories", replay_buffer=buffer)
    collector.start()
    deadline = time.monotonic() + 60
    while collector.is_running():
        assert time.monotonic() < deadline, "start() did not finish its budget within 60 s"
        time.sleep(0.01)
    collector.shutdown()
    assert len(buffer) >= 37 and len(buffer) == collector.turns_run
