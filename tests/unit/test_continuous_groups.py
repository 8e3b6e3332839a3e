"""GRPO groups across continuous slots: whole groups per batch, per-group lag, pause, shutdown, checkpoints."""
from __future__ import annotations

import time
from collections import defaultdict

import pytest
import torch

from lmcollect.buffers import ReplayBuffer
from lmcollect.collectors import ContinuousLLMCollector
from lmcollect.collectors.shared.batcher import CollectedTurn
from lmcollect.collectors.continuous.group_flow import GroupFlow
from lmcollect.data import keys
from lmcollect.data.turns import flatten_turns, non_tensor_values
from lmcollect.envs import PROMPT_ID, ChatEnv, SingleTurnTask, arithmetic_dataset
from lmcollect.envs.tasks.tool_calc import ToolCalcTask, tool_calc_dataset, tool_calc_player
from lmcollect.policies import SamplingConfig
from lmcollect.testing.scripted_engine import ByteTokenizer, ScriptedEngine, chat_script
from lmcollect.training.batch import GroupAdvantage

ROWS = tool_calc_dataset(256, seed=0)
K = 4


def group_env(seed: int, *, latency_s: float = 0.01, groups: int = 1) -> ChatEnv:
    """Multi-turn tool dialogs (1-5 turns), ``K`` answers per prompt draw."""
    task = ToolCalcTask(max_latency_s=latency_s)
    return ChatEnv(ROWS, task=task, batch_size=K * groups, repeats=K, max_turns=5, seed=seed)


def make_collector(envs, **kwargs) -> ContinuousLLMCollector:
    kwargs.setdefault("dialog_turns_per_batch", 2 * K)
    engine = kwargs.pop("engine", None) or ScriptedEngine(script=chat_script(tool_calc_player), token_delay_s=0.0005)
    return ContinuousLLMCollector(
        envs, engine=engine, tokenizer=ByteTokenizer(), sampling=SamplingConfig(max_new_tokens=64), **kwargs
    )


def groups_of(turns) -> dict[int, list]:
    groups = defaultdict(list)
    for turn in turns:
        groups[int(turn[keys.GROUP_ID])].append(turn)
    return groups


def check_whole_groups(turns, k: int = K) -> dict[int, list]:
    """Every group: exactly k dialogs, one prompt draw, every dialog whole (steps 0..n-1, the last done)."""
    groups = groups_of(turns)
    for group_id, members in groups.items():
        dialogs = defaultdict(list)
        for turn in members:
            dialogs[int(turn[keys.TRAJ_IDS])].append(turn)
        assert len(dialogs) == k, f"group {group_id} has {len(dialogs)} dialogs"
        assert len({int(t[PROMPT_ID]) for t in members}) == 1, f"group {group_id} answers several prompts"
        for dialog in dialogs.values():  # a buffer samples in any order
            dialog.sort(key=lambda t: int(t[keys.STEP_COUNT]))
        first_prompts = {non_tensor_values(d[0], keys.HISTORY_PROMPT)[0].messages[-1].content for d in dialogs.values()}
        assert len(first_prompts) == 1, f"group {group_id}'s dialogs opened with different prompts"
        for dialog in dialogs.values():
            assert [int(t[keys.STEP_COUNT]) for t in dialog] == list(range(len(dialog)))
            assert bool(dialog[-1][keys.NEXT_DONE].any())
    return groups


def test_each_batch_holds_whole_groups_of_k_dialogs_answering_one_prompt() -> None:
    collector = make_collector([group_env(s) for s in range(2)], total_dialog_turns=48)
    seen_groups, dialogs_per_batch = set(), []
    for batch in collector:
        turns = flatten_turns(batch)
        groups = check_whole_groups(turns)
        assert not seen_groups & set(groups), "a group came in two batches"
        seen_groups |= set(groups)
        dialogs_per_batch.append(len({int(t[keys.TRAJ_IDS]) for t in turns}))
    collector.shutdown()
    assert set(dialogs_per_batch) == {2 * K}  # dialog_turns_per_batch // K groups, each of K dialogs
    assert len(seen_groups) == 2 * len(dialogs_per_batch) and collector.leftover_turns is None
    # total_dialog_turns counts turns run (torchrl's rule), not dialogs: whole batches until they reach 48
    assert collector.turns_counted == collector.turns_run >= 48


def test_group_ids_are_unique_across_the_envs_and_the_slots_of_one_env() -> None:
    # one env of two groups and one of one: slots answer per env, group ids never collide
    collector = make_collector([group_env(0, groups=2), group_env(1)], total_dialog_turns=48)
    assert collector.max_dialogs_in_flight == 3 * K and collector.group_size == K
    turns = [t for batch in collector for t in flatten_turns(batch)]
    collector.shutdown()
    check_whole_groups(turns)
    by_env = defaultdict(set)
    for turn in turns:
        by_env[int(turn[keys.GROUP_ID])].add(int(turn[keys.ENV_INDEX]) // K)
    assert all(len(envs) == 1 for envs in by_env.values())


def test_single_turn_groups_give_exact_batches_and_every_group_is_normalised() -> None:
    envs = [
        ChatEnv(arithmetic_dataset(64, seed=s), task=SingleTurnTask(), batch_size=K, repeats=K, seed=s) for s in range(2)
    ]
    advantage = GroupAdvantage(group_size=K)
    collector = make_collector(
        envs, engine=ScriptedEngine(num_tokens=4), dialog_turns_per_batch=3 * K, total_dialog_turns=36, postproc=advantage
    )
    sizes = []
    for batch in collector:
        sizes.append(batch.shape[0])
        assert len(groups_of(flatten_turns(batch))) == 3
        assert advantage.pending_groups == 0  # no group waited for a later batch
    collector.shutdown()
    assert sizes == [3 * K] * 3


@pytest.mark.parametrize("max_policy_lag", [0, 1])
def test_a_group_admitted_under_version_v_leaves_by_v_plus_the_lag(max_policy_lag: int) -> None:
    envs = [group_env(s, latency_s=0.03) for s in range(3)]
    collector = make_collector(
        envs, total_dialog_turns=192, track_policy_version=True, max_policy_lag=max_policy_lag
    )
    lags = []
    for batch in collector:
        now = collector.version_index()
        for members in check_whole_groups(flatten_turns(batch)).values():
            admitted = min(int(t[keys.POLICY_VERSION]) for t in members)
            lags.append(now - admitted)
        collector.update_policy_weights_({"tag": torch.tensor([float(now + 1)])})
    collector.shutdown()
    assert len(lags) >= 12 and len(lags) % 2 == 0 and max(lags) <= max_policy_lag
    assert max(lags) == max_policy_lag or max_policy_lag == 0  # the bound is used, not just met trivially


def test_shutdown_mid_flight_writes_whole_groups_and_keeps_the_rest_as_leftovers() -> None:
    buffer = ReplayBuffer(capacity=10_000)
    collector = make_collector([group_env(s, latency_s=0.02) for s in range(2)], replay_buffer=buffer)
    collector.start()
    end = time.monotonic() + 30
    while len(buffer) < 3 * K and time.monotonic() < end:
        time.sleep(0.01)
    assert len(buffer) >= 3 * K, f"only {len(buffer)} turns reached the buffer in 30 s"
    with collector.pause():
        run, written, buffered = collector.turns_run, len(buffer), collector.num_buffered_turns
        assert collector.num_in_flight == 0 and written + buffered == run
    collector.shutdown()
    in_buffer = flatten_turns(buffer.sample(len(buffer), replace=False))
    check_whole_groups(in_buffer)  # only whole groups reach the buffer
    leftover = [] if collector.leftover_turns is None else flatten_turns(collector.leftover_turns)
    assert len(in_buffer) + len(leftover) == collector.turns_run  # nothing lost
    assert not set(groups_of(in_buffer)) & set(groups_of(leftover))


def test_a_checkpoint_mid_group_restores_the_groups_and_they_complete_whole() -> None:
    collector = make_collector([group_env(s, latency_s=0.02) for s in range(2)], track_policy_version=True)
    first = flatten_turns(collector.next())
    with collector.pause():
        state = collector.state_dict()
        held = collector.num_buffered_turns
    collector.shutdown()
    assert held > 0, "the checkpoint should hold turns of groups under way"
    fresh = make_collector([group_env(s, latency_s=0.02) for s in range(2)], track_policy_version=True)
    fresh.load_state_dict(state)
    assert fresh.num_buffered_turns == held
    with fresh:
        later = [t for _ in range(3) for t in flatten_turns(fresh.next())]
    check_whole_groups(later)
    steps = [(int(t[keys.TRAJ_IDS]), int(t[keys.STEP_COUNT])) for t in first + later]
    assert len(set(steps)) == len(steps)


def test_a_failing_dialog_leaves_its_group_which_completes_with_one_answer_fewer() -> None:
    class FailsOnce(ToolCalcTask):
        failed = False

        def respond(self, state, history):
            if not FailsOnce.failed:
                FailsOnce.failed = True
                raise RuntimeError("tool crashed")
            return super().respond(state, history)

        async def arespond(self, state, history):
            return self.respond(state, history)

    env = ChatEnv(ROWS, task=FailsOnce(max_latency_s=0.0), batch_size=K, repeats=K, max_turns=5, seed=0)
    collector = make_collector([env], dialog_turns_per_batch=K, total_dialog_turns=12)
    with pytest.raises(Exception, match="tool crashed"):
        collector.next()
    turns = [t for batch in collector for t in flatten_turns(batch)]
    collector.shutdown()
    sizes = sorted(len({int(t[keys.TRAJ_IDS]) for t in members}) for members in groups_of(turns).values())
    assert sizes[0] == K - 1 and set(sizes[1:]) == {K}


def test_group_arguments_are_checked_naming_the_knob() -> None:
    with pytest.raises(ValueError, match="max_dialogs_in_flight=8"):
        make_collector(lambda: group_env(0), max_dialogs_in_flight=6)
    with pytest.raises(ValueError, match="same repeats"):
        make_collector([group_env(0), ChatEnv(ROWS, task=ToolCalcTask(), batch_size=1, max_turns=5)])
    with pytest.raises(ValueError, match="yield_completed_trajectories"):
        make_collector([group_env(0)], yield_completed_trajectories=True)


def test_group_flow_holds_a_batch_while_an_old_group_under_way_would_miss_its_deadline() -> None:
    flow = GroupFlow(group_size=2, turns_per_batch=2, capacity=10, max_policy_lag=1, max_turns=None)
    turn = lambda slot, done: CollectedTurn(slot=slot, traj_id=slot, done=done, td=None)  # noqa: E731
    for slot, group in ((0, 1), (1, 1), (2, 2), (3, 2)):
        flow.assign(slot, group)
        flow.start_turn(0, new_dialog=True, group=group)  # groups 1 and 2 admitted under version 0
    for slot in (0, 1):
        flow.finish_turn(0, turn(slot, True))  # group 1 complete; group 2 (version 0) still under way
    assert flow.ready(0)  # at version 0 group 2 can still leave by version 1
    assert not flow.ready(1)  # at version 1 it could not: the batch waits for it
    flow.finish_turn(0, turn(2, True))
    flow.finish_turn(0, turn(3, True))
    assert flow.ready(1) and flow.num_groups_open == 0


def test_a_grouped_turn_budget_yields_whole_groups_within_the_stated_overshoot() -> None:
    """docs/collectors.md, "Turn budget": groups of k, G groups a batch, dialogs of up to T turns, g groups
    at once: at least N turns and at most N - 1 + k + g*k*(T - 1) + (G - 1)*k*T, in whole batches of whole groups."""
    budget, per_batch, max_turns, slots = 120, 2 * K, 5, 2 * K
    collector = make_collector([group_env(seed) for seed in range(slots // K)], dialog_turns_per_batch=per_batch,
                               total_dialog_turns=budget)  # fmt: skip
    try:
        batches = [batch for batch, _ in zip(collector, range(100), strict=False)]
    finally:
        collector.shutdown()
    turns = [turn for batch in batches for turn in flatten_turns(batch)]
    groups_per_batch, groups_at_once = per_batch // K, slots // K
    bound = budget - 1 + K + groups_at_once * K * (max_turns - 1) + (groups_per_batch - 1) * K * max_turns
    assert budget <= len(turns) == collector.turns_counted == collector.turns_run <= bound, (len(turns), bound)
    assert all(len(groups_of(flatten_turns(batch))) == groups_per_batch for batch in batches)
    check_whole_groups(turns)


def test_a_draw_skipped_by_one_slot_is_admitted_past_the_capacity_its_partner_filled() -> None:
    """Slot 1's dialog of draw 1 fails before starting; slot 1 runs ahead into draws 2 and 3, which fill
    the capacity and wait for slot 0. Slot 0 reaching draw 1 must be admitted, or nothing moves."""
    flow = GroupFlow(group_size=2, turns_per_batch=4, capacity=3, max_policy_lag=None, max_turns=None)  # 2 groups a batch
    turn = lambda slot, done: CollectedTurn(slot=slot, traj_id=slot, done=done, td=None)  # noqa: E731
    for slot in (0, 1):  # both slots answer draw 0
        flow.assign(slot, 0)
        assert flow.may_start(new_dialog=True, version_index=0, group=0)
        flow.start_turn(0, new_dialog=True, group=0)
    flow.finish_turn(0, turn(1, done=True))  # slot 1 is done with draw 0; slot 0 is still at it
    flow.assign(1, 1)
    flow.drop_dialog(1)  # slot 1's dialog of draw 1 failed before its first turn
    for group in (2, 3):  # slot 1 runs ahead
        flow.assign(1, group)
        assert flow.may_start(new_dialog=True, version_index=0, group=group)
        flow.start_turn(0, new_dialog=True, group=group)
        flow.finish_turn(0, turn(1, done=True))
    flow.finish_turn(0, turn(0, done=True))  # slot 0 ends draw 0: its group waits for a second one
    assert not flow.ready(0) and len(flow.groups.kept) + len(flow.groups.open) == flow.capacity  # 2, 3 wait for slot 0
    flow.assign(0, 1)
    assert flow.may_start(new_dialog=True, version_index=0, group=1)  # the older draw goes first
    assert not flow.may_start(new_dialog=True, version_index=0, group=4)  # a newer one still waits
