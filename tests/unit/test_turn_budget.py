"""A finite collector keeps torchrl's turn budget: ``total_dialog_turns`` counts the env dialog turns that ran.

The rule (docs/collectors.md, "Turn budget"; torchrl 0.14.1's ``LLMCollector``): a collector yields
whole batches until the turns run for them reach ``total_dialog_turns`` (``turns_counted``). A
yielded row counts one turn, except with ``yield_only_last_steps``, where a last step counts every
turn of its trajectory (the intermediate ones ran and were left out), so a 3-turn dialog with
``total_dialog_turns=3`` completes one trajectory, not three. Steps mode yields exactly
``ceil(total / B) * B`` turns; trajectories mode at least ``total`` (its last batch takes every
trajectory completed by then); last-steps mode full batches until their trajectories' turns reach
``total``. Every yielded (trajectory, step) is unique, and every turn run is counted or still held
by the collector (``turns_run == turns_counted + num_buffered_turns``): nothing run is lost.
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
from tests.factories import UnevenEnv, make_silent_player, make_three_turn_env, make_uneven_guessing_env

MODES = {
    "steps": {},
    "trajectories": {"yield_completed_trajectories": True},
    "last_steps": {"yield_only_last_steps": True},
}
MAX_TURNS = 5  # of the guessing game: the longest a dialog runs


def guessing_env(seed: int, batch_size: int = 1) -> ChatEnv:
    rows = guessing_game_dataset(32, seed=seed)
    return ChatEnv(rows, task=GuessingGameTask(), batch_size=batch_size, max_turns=MAX_TURNS, seed=seed)


def arithmetic_env(seed: int, batch_size: int = 2) -> ChatEnv:
    return ChatEnv(arithmetic_dataset(64, seed=seed), reward_fn=MathAnswerReward(), batch_size=batch_size, seed=seed)


def ids_of(batches) -> list[tuple[int, int]]:
    return [(int(t.get(keys.TRAJ_IDS)), int(t.get(keys.STEP_COUNT))) for b in batches for t in flatten_turns(b)]


def counted_in(batch, mode: str) -> int:
    """The turns a batch stands for: a row each, a last step its whole trajectory (step count + 1)."""
    if mode != "last_steps":
        return batch.batch_size.numel()
    return sum(int(t.get(keys.STEP_COUNT)) + 1 for t in flatten_turns(batch))


def check_budget(collector, batches, mode: str, total: int, per_batch: int, num_slots: int) -> None:
    ids = ids_of(batches)
    assert len(ids) == len(set(ids)), "a (trajectory, step) was yielded twice"
    assert collector.turns_yielded == len(ids)
    counts = [counted_in(b, mode) for b in batches]
    assert collector.turns_counted == sum(counts), "turns_counted is not the turns the batches stand for"
    if mode == "steps":
        rows = math.ceil(per_batch / num_slots) * num_slots
        assert len(ids) == sum(counts) == math.ceil(total / rows) * rows, f"yielded {len(ids)} turns"
    else:
        assert sum(counts) >= total, f"counted {sum(counts)} turns of the {total} promised"
        assert sum(counts[:-1]) < total, f"the budget was reached before the last batch: {counts}"
    if mode == "last_steps":
        assert all(b.batch_size.numel() == per_batch for b in batches), "a last-steps batch is not full"
    # nothing run is lost: every turn run is counted, or held for the next batches (dialogs under way)
    assert collector.turns_run == collector.turns_counted + collector.num_buffered_turns
    held_at_most = {"steps": 0, "trajectories": (MAX_TURNS - 1) * num_slots}
    held_at_most["last_steps"] = MAX_TURNS * (num_slots + per_batch)  # + completed trajectories no batch took
    assert collector.num_buffered_turns <= held_at_most[mode], f"ran {collector.num_buffered_turns} turns past the batches"


@pytest.mark.parametrize("mode", list(MODES))
def test_one_env_yields_the_promised_turns(mode: str) -> None:
    collector = LLMCollector(
        guessing_env(0, batch_size=3), policy=ScriptedPolicy(binary_search_player),
        dialog_turns_per_batch=10, total_dialog_turns=37, **MODES[mode],
    )
    batches = list(collector)
    check_budget(collector, batches, mode, total=37, per_batch=10, num_slots=3)
    with pytest.raises(StopIteration, match="run total_dialog_turns=37"):
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


# ---------------------------------------------------------------------- last steps: dropped turns count
@pytest.mark.parametrize(("total", "per_batch", "batches"), [(3, 1, 1), (48, 4, 4)])
def test_three_turn_dialogs_with_last_steps_run_the_budget_not_three_times_it(total, per_batch, batches) -> None:
    # torchrl's rule: "a 3-turn dialog with total_dialog_turns=3 completes one trajectory, not three"
    collector = LLMCollector(
        make_three_turn_env(0, batch_size=per_batch), policy=make_silent_player(),
        dialog_turns_per_batch=per_batch, total_dialog_turns=total, yield_only_last_steps=True,
    )
    out = list(collector)
    assert [b.batch_size.numel() for b in out] == [per_batch] * batches
    assert collector.turns_run == collector.turns_counted == total and collector.turns_yielded == total // 3
    assert all(int(t.get(keys.STEP_COUNT)) == 2 for b in out for t in flatten_turns(b)), "a row is not a last step"
    check_budget(collector, out, "last_steps", total=total, per_batch=per_batch, num_slots=per_batch)


def test_async_envs_with_last_steps_stop_once_the_trajectories_cover_the_budget() -> None:
    envs = [UnevenEnv(make_three_turn_env(s), seed=s, max_delay_s=0.002 * s) for s in range(4)]
    collector = LLMCollector(
        envs, async_envs=True, policy=make_silent_player(),
        dialog_turns_per_batch=4, total_dialog_turns=48, yield_only_last_steps=True,
    )
    out = list(collector)
    collector.shutdown()
    assert len(out) == 4 and collector.turns_counted == 48
    check_budget(collector, out, "last_steps", total=48, per_batch=4, num_slots=4)
    # a thread steps only while the completed trajectories do not cover the budget: the others may
    # each be inside one dialog then (its turns kept for the next batch), and run no turn past it
    assert collector.turns_run - 48 <= 3 * 3


@pytest.mark.parametrize("async_envs", [False, True], ids=["one_env", "async_envs"])
def test_start_with_last_steps_writes_batches_until_their_turns_reach_the_budget(async_envs: bool) -> None:
    buffer = ReplayBuffer(capacity=1000)
    envs = [make_three_turn_env(s, batch_size=2) for s in range(2)] if async_envs else make_three_turn_env(0, 4)
    collector = LLMCollector(
        envs, async_envs=async_envs, policy=make_silent_player(), replay_buffer=buffer,
        dialog_turns_per_batch=4, total_dialog_turns=50, yield_only_last_steps=True,
    )
    collector.start()
    collector._background.join(60)
    assert not collector.is_running(), "start() did not finish its budget within 60 s"
    collector.shutdown()
    # batches of 4 last steps stand for 12 turns: 5 batches reach 50 (4 would count 48)
    assert len(buffer) == collector.turns_yielded == 20 and collector.turns_counted == 60
    assert collector.turns_run == 60 + collector.num_buffered_turns


def test_a_restored_last_steps_collector_keeps_the_turns_it_counted() -> None:
    def build() -> LLMCollector:
        return LLMCollector(
            make_three_turn_env(0, batch_size=2), policy=make_silent_player(),
            dialog_turns_per_batch=2, total_dialog_turns=24, yield_only_last_steps=True,
        )

    first = build()
    before = [first.next(), first.next()]
    assert first.turns_counted == 12
    second = build()
    second.load_state_dict(first.state_dict())
    after = list(second)
    assert len(after) == 2 and second.turns_counted == 24 == second.turns_run
    ids = ids_of(before + after)
    assert len(ids) == len(set(ids)) == 8


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
    assert len(ids) == len(set(ids)) == collector.turns_yielded
    counts = [counted_in(b, mode) for b in batches]
    assert collector.turns_counted == sum(counts)
    if mode == "steps":
        assert sum(counts) == collector.turns_run == 40, "ceil(37 / 10) whole batches of 10"
    else:  # no dialog starts once 37 turns have; the ones under way finish and are yielded (the last batch)
        assert 37 <= sum(counts) == collector.turns_run < 37 + 4 * MAX_TURNS, "every turn run is counted"
        assert all(b.batch_size.numel() >= 10 for b in batches[:-1])


def test_the_continuous_collector_counts_the_dropped_turns_of_last_steps() -> None:
    collector = ContinuousLLMCollector(
        [make_three_turn_env(s) for s in range(4)],
        engine=ScriptedEngine(script=chat_script(lambda _history: "I would rather not say.")),
        tokenizer=ByteTokenizer(), sampling=SamplingConfig(max_new_tokens=32),
        dialog_turns_per_batch=4, total_dialog_turns=48, yield_only_last_steps=True,
    )
    try:
        batches = list(collector)
    finally:
        collector.shutdown()
    rows = [b.batch_size.numel() for b in batches]
    assert collector.turns_counted == collector.turns_run == 3 * sum(rows), "every dialog run is counted whole"
    # 16 dialogs make the budget; the 3 other slots may each have begun one more when the 48th turn started
    assert 48 <= collector.turns_run <= 48 + 3 * 3 and rows[:4] == [4, 4, 4, 4]
    assert collector.leftover_turns is None


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
