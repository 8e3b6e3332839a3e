"""Dynamic sampling: group filters, refills to exact batches, the lag bound, the buffer, counts across restores, the drop bound."""
from __future__ import annotations

import threading
import time
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from lmcollect.buffers import ReplayBuffer
from lmcollect.checkpoint import load_checkpoint, save_checkpoint
from lmcollect.collectors import (
    ContinuousLLMCollector,
    DynamicSampling,
    LLMCollector,
    SamplingCounts,
    drop_uniform_rewards,
    keep_mean_reward_in,
)
from lmcollect.collectors.shared.batcher import CollectedTurn
from lmcollect.collectors.shared.group_filter import STALE, UNIFORM_REWARDS
from lmcollect.collectors.continuous.group_flow import GroupFlow
from lmcollect.data import History, keys
from lmcollect.data.turns import flatten_turns
from lmcollect.envs import ChatEnv, SingleTurnTask
from lmcollect.policies import SamplingConfig
from lmcollect.testing import ScriptedPolicy
from lmcollect.testing.scripted_engine import ByteTokenizer, ScriptedEngine, chat_script
from lmcollect.training.batch import GroupAdvantage

K = 4
# rows named "same" are always answered "A" (every reward 1: a uniform group); "mixed" rows alternate A / B
ROWS = [{"prompt": f"{'same' if i % 2 == 0 else 'mixed'} {i}"} for i in range(64)]


class Answers:
    """The scripted player: "A" (reward 1) to every "same" row; "A", "B", "A"... to the "mixed" ones."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = 0

    def __call__(self, history: History) -> str:
        if history.messages[-1].content.startswith("same"):
            return "A"
        with self._lock:
            self._count += 1
            return "AB"[self._count % 2]


def reward(history: History) -> float:
    return 1.0 if history.last("assistant").content == "A" else 0.0


def env(seed: int, groups: int = 1) -> ChatEnv:
    return ChatEnv(ROWS, task=SingleTurnTask(reward), batch_size=K * groups, repeats=K, seed=seed)


def continuous(num_envs: int = 2, **kwargs) -> ContinuousLLMCollector:
    kwargs.setdefault("dialog_turns_per_batch", 2 * K)
    kwargs.setdefault("dynamic_sampling", drop_uniform_rewards())
    engine = ScriptedEngine(script=chat_script(Answers()), token_delay_s=0.0005)
    return ContinuousLLMCollector(
        [env(s) for s in range(num_envs)], engine=engine, tokenizer=ByteTokenizer(),
        sampling=SamplingConfig(max_new_tokens=8), **kwargs,
    )


def lockstep(**kwargs) -> LLMCollector:
    kwargs.setdefault("dialog_turns_per_batch", 2 * K)
    kwargs.setdefault("dynamic_sampling", drop_uniform_rewards())
    return LLMCollector(env(0, groups=2), policy=ScriptedPolicy(Answers()), **kwargs)


def groups_of(turns) -> dict[int, list]:
    groups = defaultdict(list)
    for turn in turns:
        groups[int(turn[keys.GROUP_ID])].append(turn)
    return dict(groups)


def rewards_of(members) -> list[float]:
    return [float(t[keys.NEXT_REWARD].sum()) for t in members]


def response_tokens(turns) -> int:
    return sum(int(t[keys.TOKENS_RESPONSE].numel()) for t in turns)


def check_counts(counts: SamplingCounts) -> None:
    assert counts.groups_generated == counts.groups_kept + counts.dropped + counts.groups_waiting
    assert counts.groups_waiting >= 0 and counts.tokens_delivered <= counts.tokens_generated


# ---------------------------------------------------------------------- kept groups, exact batches
@pytest.mark.parametrize("make", [continuous, lockstep], ids=["continuous", "lockstep"])
def test_batches_hold_exactly_g_kept_groups_none_with_equal_rewards(make) -> None:
    collector = make(total_dialog_turns=6 * 2 * K)
    delivered = []
    for batch in collector:
        turns = flatten_turns(batch)
        groups = groups_of(turns)
        assert batch.shape == (2 * K,) and len(groups) == 2  # exactly dialog_turns_per_batch // k kept groups
        for members in groups.values():
            assert len({int(t[keys.TRAJ_IDS]) for t in members}) == K
            assert len(set(rewards_of(members))) > 1, "a kept group has all-equal rewards"
        last = collector.last_batch_counts
        assert last.groups_kept == 2 and last.batches == 1 and last.tokens_delivered == response_tokens(turns)
        delivered += turns
    counts = collector.sampling_counts
    collector.shutdown()
    check_counts(counts)
    assert counts.groups_kept == 12 and counts.batches == 6
    assert counts.groups_dropped.get(UNIFORM_REWARDS, 0) >= 1, "the 'same' rows should have been dropped"
    assert counts.tokens_delivered == response_tokens(delivered) < counts.tokens_generated


def test_group_advantage_after_the_filter_never_sees_a_zero_advantage_group() -> None:
    advantage = GroupAdvantage(group_size=K)
    collector = continuous(total_dialog_turns=4 * K, postproc=advantage)
    for batch in collector:
        values = torch.stack([t["advantage"] for t in flatten_turns(batch)])
        assert bool((values != 0).all())
    collector.shutdown()


# ---------------------------------------------------------------------- the lag bound with refills
@pytest.mark.parametrize(("max_policy_lag", "oversample_groups"), [(0, 0), (1, 0), (0, 2), (1, 2)])
def test_no_kept_group_is_older_than_the_lag_bound_under_a_push_every_batch(max_policy_lag, oversample_groups) -> None:
    sampling = DynamicSampling(group_filter=drop_uniform_rewards(), oversample_groups=oversample_groups)
    collector = continuous(
        num_envs=3, total_dialog_turns=8 * 2 * K, track_policy_version=True, max_policy_lag=max_policy_lag,
        dynamic_sampling=sampling,
    )
    lags = []
    for batch in collector:
        now = collector.version_index()
        groups = groups_of(flatten_turns(batch))
        assert len(groups) == 2
        for members in groups.values():
            assert len(set(rewards_of(members))) > 1
            lags.append(now - min(int(t[keys.POLICY_VERSION]) for t in members))
        collector.update_policy_weights_({"tag": torch.tensor([float(now + 1)])})
    counts = collector.sampling_counts
    collector.shutdown()
    assert len(lags) == 16 and max(lags) <= max_policy_lag
    assert counts.groups_dropped.get(UNIFORM_REWARDS, 0) >= 1  # refills happened
    if oversample_groups == 0:
        assert STALE not in counts.groups_dropped  # without over-sampling every deadline is met


def test_the_flow_drops_a_kept_group_past_its_deadline_as_stale_and_admits_a_refill() -> None:
    sampling = DynamicSampling(group_filter=drop_uniform_rewards(), oversample_groups=1)
    flow = GroupFlow(group_size=2, turns_per_batch=2, capacity=1, max_policy_lag=0, max_turns=None, sampling=sampling)

    def finish(slot: int, group: int, reward: float) -> None:
        td = _turn_td(reward)
        flow.finish_turn(0, CollectedTurn(slot=slot, traj_id=slot, done=True, td=td))

    for slot, group in ((0, 1), (1, 1), (2, 2), (3, 2)):  # capacity 1 + 1 over-sampled group at version 0
        flow.assign(slot, group)
        assert flow.may_start(new_dialog=True, version_index=0, group=group)
        flow.start_turn(0, new_dialog=True, group=group)
    assert not flow.may_start(new_dialog=True, version_index=0, group=3)
    for slot, group, r in ((0, 1, 0.0), (1, 1, 1.0), (2, 2, 1.0), (3, 2, 0.0)):
        finish(slot, group, r)
    assert flow.ready(0)
    flow.pop(0)  # group 1; group 2 was kept too, but a batch under version 1 may not take it (lag 0)
    assert not flow.ready(1)
    assert flow.tally.total.groups_dropped == {STALE: 1} and flow.tally.total.groups_kept == 1
    assert flow.may_start(new_dialog=True, version_index=1, group=3)  # its place went to a refill


def _turn_td(reward: float):
    from tensordict import TensorDict

    return TensorDict(
        {keys.TOKENS_RESPONSE: torch.tensor([65, 256]), "next": {"reward": torch.tensor([reward])}}, batch_size=[]
    )


# ---------------------------------------------------------------------- the replay buffer
@pytest.mark.parametrize("make", [continuous, lockstep], ids=["continuous", "lockstep"])
def test_dropped_groups_never_reach_the_replay_buffer(make) -> None:
    buffer = ReplayBuffer(capacity=10_000)
    collector = make(replay_buffer=buffer)
    collector.start()
    end = time.monotonic() + 30
    while len(buffer) < 6 * K and time.monotonic() < end:
        time.sleep(0.01)
    assert len(buffer) >= 6 * K, f"only {len(buffer)} turns reached the buffer in 30 s"
    collector.shutdown()
    counts = collector.sampling_counts
    turns = flatten_turns(buffer.sample(len(buffer), replace=False))
    groups = groups_of(turns)
    assert all(len(set(rewards_of(members))) > 1 for members in groups.values())
    assert counts.dropped >= 1 and len(groups) == counts.groups_kept
    assert response_tokens(turns) == counts.tokens_delivered


# ---------------------------------------------------------------------- counts across shutdown and restore
class RecordingFilter:
    """drop_uniform_rewards, recording every decision (shared by the collector and its restored copy)."""

    def __init__(self) -> None:
        self.decisions: list[str | None] = []
        self._filter = drop_uniform_rewards()

    def __call__(self, rewards: torch.Tensor) -> str | None:
        decision = self._filter(rewards)
        self.decisions.append(decision)
        return decision


@pytest.mark.parametrize("make", [continuous, lockstep], ids=["continuous", "lockstep"])
def test_counts_are_exact_across_shutdown_and_restore(make, tmp_path: Path) -> None:
    recorder = RecordingFilter()
    first = make(dynamic_sampling=recorder, track_policy_version=True)
    delivered = [t for _ in range(2) for t in flatten_turns(first.next())]
    with first.pause():
        save_checkpoint(tmp_path / "ckpt", [first])
        saved, judged = first.sampling_counts, list(recorder.decisions)
    first.shutdown()  # what it judges after the checkpoint is lost with it
    assert saved.groups_generated == len(judged)
    second = make(dynamic_sampling=recorder, track_policy_version=True)
    load_checkpoint(tmp_path / "ckpt", [second])
    assert second.sampling_counts == saved
    recorder.decisions.clear()
    delivered += [t for _ in range(3) for t in flatten_turns(second.next())]
    with second.pause():
        counts = second.sampling_counts
        judged += recorder.decisions
    second.shutdown()
    check_counts(counts)
    assert counts.groups_generated == len(judged)
    assert counts.groups_dropped == {UNIFORM_REWARDS: judged.count(UNIFORM_REWARDS)}
    assert counts.groups_kept == len(groups_of(delivered)) == 10 and counts.batches == 5
    assert counts.tokens_delivered == response_tokens(delivered)


# ---------------------------------------------------------------------- a filter that drops everything
class DropAll:
    def __call__(self, rewards: torch.Tensor) -> str:
        return "never_good_enough"

    def __repr__(self) -> str:
        return "DropAll()"


@pytest.mark.parametrize("make", [continuous, lockstep], ids=["continuous", "lockstep"])
def test_a_filter_dropping_everything_ends_collection_with_an_error_within_the_bound(make) -> None:
    collector = make(dynamic_sampling=DynamicSampling(group_filter=DropAll(), max_consecutive_drops=5))
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"DropAll\(\) dropped 5 groups in a row.*never_good_enough"):
        collector.next()
    with pytest.raises(RuntimeError, match="max_consecutive_drops=5"):  # and again: collection stays ended
        collector.next()
    collector.shutdown()
    counts = collector.sampling_counts
    assert time.monotonic() - start < 20
    # the groups under way when the bound was reached still finish, nothing new is admitted
    assert 5 <= counts.groups_generated <= 5 + 2 * 2 and counts.groups_kept == 0
    assert counts.groups_dropped == {"never_good_enough": counts.groups_generated}


# ---------------------------------------------------------------------- settings, filters, counts
def test_settings_are_checked_naming_the_knob() -> None:
    with pytest.raises(ValueError, match="oversample_groups must be an int >= 0"):
        DynamicSampling(group_filter=drop_uniform_rewards(), oversample_groups=-1)
    with pytest.raises(TypeError, match="group_filter must be callable"):
        DynamicSampling(group_filter="uniform")
    with pytest.raises(ValueError, match="low=1 must be <= high=0"):
        keep_mean_reward_in(1, 0)
    with pytest.raises(ValueError, match="repeats"):
        LLMCollector(ChatEnv(ROWS, task=SingleTurnTask(reward), batch_size=2), policy=ScriptedPolicy(),
                     dialog_turns_per_batch=2, dynamic_sampling=drop_uniform_rewards())
    with pytest.raises(ValueError, match="oversample_groups=1: LLMCollector"):
        lockstep(dynamic_sampling=DynamicSampling(group_filter=drop_uniform_rewards(), oversample_groups=1))
    with pytest.raises(ValueError, match="flatten_data=False"):
        lockstep(flatten_data=False)
    with pytest.raises(TypeError, match="dynamic_sampling must be"):
        lockstep(dynamic_sampling=3)


@pytest.mark.parametrize("make", [continuous, lockstep], ids=["continuous", "lockstep"])
def test_a_filter_that_fails_or_returns_something_else_ends_collection_naming_it(make) -> None:
    collector = make(dynamic_sampling=lambda rewards: 0.5)
    with pytest.raises(TypeError, match=r"returned 0\.5"):
        collector.next()
    collector.shutdown()
    assert collector.sampling_counts.groups_dropped.get("filter_error", 0) >= 1

    def crashes(rewards):
        raise ZeroDivisionError("the filter's own bug")

    collector = make(dynamic_sampling=crashes)
    with pytest.raises(ZeroDivisionError, match="the filter's own bug") as raised:
        collector.next()
    collector.shutdown()
    assert any("crashes" in note for note in raised.value.__notes__)


def test_shipped_filters_and_counts() -> None:
    uniform = drop_uniform_rewards(tol=0.1)
    assert uniform(torch.tensor([1.0, 1.05])) == UNIFORM_REWARDS and uniform(torch.tensor([0.0, 1.0])) is None
    band = keep_mean_reward_in(0.2, 0.8)
    assert band(torch.tensor([0.0, 0.0])) == "mean_below_band" and band(torch.tensor([1.0, 1.0])) == "mean_above_band"
    assert band(torch.tensor([0.0, 1.0])) is None
    a = SamplingCounts(groups_generated=4, groups_kept=2, groups_dropped={"x": 1}, tokens_generated=10, tokens_delivered=6)
    b = SamplingCounts(groups_generated=1, groups_dropped={"x": 1, "y": 1}, tokens_generated=3)
    assert a.plus(b).groups_dropped == {"x": 2, "y": 1} and a.plus(b).minus(b) == a
    metrics = a.as_metrics()
    assert metrics["sampling/kept_share"] == 0.75 and metrics["sampling/dropped/x"] == 1
    assert metrics["sampling/delivered_token_share"] == 0.6 and a.groups_waiting == 1


def test_the_demo_summary_shows_kept_and_dropped_groups_and_tokens() -> None:
    from lmcollect.cli.report import sampling_rows

    counts = SamplingCounts(groups_generated=10, groups_kept=6, groups_dropped={UNIFORM_REWARDS: 3},
                            tokens_generated=400, tokens_delivered=240)
    on = {"mode": "auto", "on": True, "counts": counts.to_state(),
          "kept_share": {"first_10_steps": 0.9, "last_10_steps": 0.4}}
    rows = dict(sampling_rows(on))
    assert rows["groups kept in batches / generated (dropped)"] == "6 / 10 (3: uniform_rewards 3)"
    assert rows["kept share of groups, first / last 10 steps"] == "0.90 / 0.40"
    assert rows["tokens delivered / generated"] == "240 / 400 (60%)"
    assert sampling_rows({**on, "on": False, "counts": None}) == [("dynamic sampling", "off (auto)")]


def test_lockstep_multi_turn_groups_leave_whole_also_after_a_reset_cuts_some() -> None:
    from lmcollect.envs import ToolCalcTask, tool_calc_dataset, tool_calc_player
    from tests.factories import EveryOtherGroup

    tool_env = ChatEnv(tool_calc_dataset(64, seed=0), task=ToolCalcTask(max_latency_s=0.0), batch_size=2 * K,
                       repeats=K, max_turns=5, seed=0)
    collector = LLMCollector(tool_env, policy=ScriptedPolicy(tool_calc_player), dialog_turns_per_batch=2 * K,
                             dynamic_sampling=EveryOtherGroup())
    batches = [collector.next() for _ in range(2)]
    collector.reset([0])  # cuts the dialog of slot 0: its group (and every other one under way) is dropped
    batches += [collector.next() for _ in range(2)]
    collector.shutdown()
    seen: set[int] = set()
    for batch in batches:
        groups = groups_of(flatten_turns(batch))
        assert len(groups) == 2 and not seen & set(groups)
        seen |= set(groups)
        for members in groups.values():
            dialogs = defaultdict(list)
            for turn in members:
                dialogs[int(turn[keys.TRAJ_IDS])].append(turn)
            assert len(dialogs) == K
            for dialog in dialogs.values():
                assert [int(t[keys.STEP_COUNT]) for t in dialog] == list(range(len(dialog)))
                assert bool(dialog[-1][keys.NEXT_DONE].any()) and len(dialog) > 1
    counts = collector.sampling_counts
    assert counts.groups_kept == 8 and counts.groups_dropped["every_other"] >= 7
