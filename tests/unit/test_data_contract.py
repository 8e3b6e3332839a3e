"""The data contract without Ray: pushed versions, id blocks and group ids, per-turn checks, locks."""
from __future__ import annotations

import threading
import time
from collections import Counter

import pytest
import torch
from tensordict import TensorDict, lazy_stack
from torch import nn

from lmcollect.buffers import ReplayBuffer
from lmcollect.collectors import LLMCollector
from lmcollect.collectors.shared.trajectories import TrajectoryTracker, id_base
from lmcollect.data import keys
from lmcollect.data.history import History
from lmcollect.data.turns import flatten_turns
from lmcollect.envs import ChatEnv, MathAnswerReward, arithmetic_dataset
from lmcollect.testing import ScriptedPolicy
from lmcollect.training.batch import GroupAdvantage
from lmcollect.training.grpo import ADVANTAGE
from lmcollect.weight_sync import LocalWeightUpdater

from tests.unit.test_weight_sync import ModelPolicy, TinyNet, assert_weights, make_collector, state, trained


def arithmetic_env(batch_size: int = 4, repeats: int = 1, seed: int = 0) -> ChatEnv:
    return ChatEnv(
        arithmetic_dataset(64, seed=seed), reward_fn=MathAnswerReward(), batch_size=batch_size, repeats=repeats, seed=seed
    )


def turn_values(batch, key) -> list[int]:
    return [int(t.get(key)) for t in flatten_turns(batch)]


# ---------------------------------------------------------------------- 1. versions belong to the push
def test_the_push_assigns_the_version_and_it_only_goes_up() -> None:
    updater = LocalWeightUpdater(trained())
    collector = make_collector(weight_updater=updater)
    updater.push_weights()
    assert collector.policy_version == updater.version == 1
    updater.push_weights(version=7)
    assert collector.policy_version == 7 and set(turn_values(collector.next(), keys.POLICY_VERSION)) == {7}
    before = state(collector)
    for stale in (7, 3):
        with pytest.raises(ValueError, match=f"version={stale} is not above the last pushed version 7"):
            updater.push_weights(TinyNet(), version=stale)
    assert collector.policy_version == 7 and all(torch.equal(before[k], v) for k, v in state(collector).items())
    with pytest.raises(TypeError, match="version must be an int"):
        updater.push_weights(version="8")


def test_collectors_holding_the_same_push_report_the_same_version() -> None:
    # two collectors, two updaters whose counters differ: the version comes with the weights
    a, b = make_collector(), make_collector()
    weights = trained().state_dict()
    a.receive_weights(weights)  # a direct load counts up locally: 1
    pushed = LocalWeightUpdater()
    b.weight_updater = pushed
    pushed.push_weights(weights, version=5)
    a_updater = LocalWeightUpdater()
    a.weight_updater = a_updater
    a_updater.push_weights(weights, version=5)
    assert a.policy_version == b.policy_version == 5


def test_a_receiver_refuses_an_older_version_before_loading_anything() -> None:
    collector = make_collector(weight_updater=LocalWeightUpdater())
    collector.weight_updater.push_weights(trained(), version=4)
    before = state(collector)
    from lmcollect.weights.version import PushVersion

    with pytest.raises(ValueError, match="older than this collector's version 4"):
        collector.receive_weights(TinyNet().state_dict(), version=PushVersion(2))
    assert all(torch.equal(before[k], v) for k, v in state(collector).items())


def test_untracked_collectors_stay_untracked_after_pushes() -> None:
    collector = LLMCollector(
        arithmetic_env(2), policy=ModelPolicy(), dialog_turns_per_batch=2, weight_updater=LocalWeightUpdater(trained())
    )
    collector.update_policy_weights_()
    collector.increment_version()
    assert collector.policy_version is None
    assert set(turn_values(collector.next(), keys.POLICY_VERSION)) == {-1}


def test_load_state_dict_is_a_push_lock_cache_and_version() -> None:
    weights = trained()
    source = make_collector(weight_updater=LocalWeightUpdater(weights))
    source.weight_updater.push_weights(version=3)
    saved = source.state_dict()
    target = make_collector()
    resets = target.policy.cache_resets
    target.load_state_dict(saved)
    assert target.policy_version == 3 and target.policy.cache_resets == resets + 1
    assert_weights(target, weights)
    newer = make_collector(weight_updater=LocalWeightUpdater(TinyNet()))
    newer.weight_updater.push_weights(version=9)
    before = state(newer)
    with pytest.raises(ValueError, match="older than this collector's version 9"):
        newer.load_state_dict(saved)
    assert all(torch.equal(before[k], v) for k, v in state(newer).items())


def test_load_state_dict_waits_for_the_turn_under_way() -> None:
    collector = make_collector()
    saved = make_collector().state_dict()
    gate, entered = threading.Event(), threading.Event()
    original = collector.policy.__call__

    def slow_policy(td):
        entered.set()
        gate.wait(10)
        return original(td)

    collector._runners.runners[0].policy = slow_policy
    worker = threading.Thread(target=collector.next)
    worker.start()
    assert entered.wait(10)
    loader = threading.Thread(target=collector.load_state_dict, args=(saved,))
    loader.start()
    time.sleep(0.3)
    assert loader.is_alive(), "load_state_dict ran while a turn was under way"
    gate.set()
    worker.join(10)
    loader.join(10)
    assert not loader.is_alive()


# ---------------------------------------------------------------------- 3. group ids
def test_group_ids_are_unique_across_async_envs_and_collectors() -> None:
    def collector(worker_idx: int | None) -> LLMCollector:
        c = LLMCollector(
            [lambda: arithmetic_env(4, repeats=2, seed=0), lambda: arithmetic_env(4, repeats=2, seed=1)],
            async_envs=True,
            policy=ScriptedPolicy("#### 1"),
            dialog_turns_per_batch=16,
            flatten_data=True,
        )
        if worker_idx is not None:
            c.worker_idx = worker_idx
        return c

    collectors = [collector(0), collector(1), collector(None), collector(None)]
    turns = [t for c in collectors for t in flatten_turns(c.next())]
    for c in collectors:
        c.shutdown()
    prompt_ids = Counter(int(t.get(keys.ENV_PROMPT_ID)) for t in turns)
    assert max(prompt_ids.values()) > 2, "the envs' own prompt ids collide (what group ids must fix)"
    groups: dict[int, set[str]] = {}
    for t in turns:
        groups.setdefault(int(t.get(keys.GROUP_ID)), set()).add(t.get_non_tensor(keys.HISTORY_PROMPT).messages[-1].content)
    sizes = Counter(int(t.get(keys.GROUP_ID)) for t in turns)
    assert set(sizes.values()) == {2}, "each group holds exactly its repeats answers"
    assert all(len(prompts) == 1 for prompts in groups.values()), "a group mixes prompts"
    assert {g >> 32 for g in groups if g >> 32 < 2} == {0, 1}


def test_separately_built_collectors_get_disjoint_id_blocks() -> None:
    a = LLMCollector(arithmetic_env(2), policy=ScriptedPolicy("1"), dialog_turns_per_batch=2)
    b = LLMCollector(arithmetic_env(2), policy=ScriptedPolicy("1"), dialog_turns_per_batch=2)
    ids_a, ids_b = turn_values(a.next(), keys.TRAJ_IDS), turn_values(b.next(), keys.TRAJ_IDS)
    assert ids_a[0] >> 32 != ids_b[0] >> 32 and not set(ids_a) & set(ids_b)
    a.worker_idx = 5
    assert all(i >> 32 == 5 for i in turn_values(a.next(), keys.TRAJ_IDS))


def test_group_advantage_waits_for_complete_groups() -> None:
    def turn(group: int, reward: float) -> TensorDict:
        return TensorDict(
            {"next": {"reward": torch.tensor([reward])}, "collector": {"group_id": torch.tensor(group)}}, batch_size=[]
        )

    postproc = GroupAdvantage(group_size=2)
    first = postproc(lazy_stack([turn(10, 1.0), turn(10, 0.0), turn(11, 1.0)]))
    assert [round(float(t.get(ADVANTAGE)), 3) for t in flatten_turns(first)] == [0.707, -0.707]
    assert postproc.pending_groups == 1  # group 11 waits for its second answer
    assert postproc(lazy_stack([turn(12, 0.0)])) is None
    second = postproc(lazy_stack([turn(11, 0.0), turn(12, 1.0)]))
    assert sorted(int(t.get(keys.GROUP_ID)) for t in flatten_turns(second)) == [11, 11, 12, 12]
    assert postproc.pending_groups == 0
    with pytest.raises(ValueError, match="more than group_size=2"):
        postproc(lazy_stack([turn(13, 0.0), turn(13, 0.0), turn(13, 1.0)]))


# ---------------------------------------------------------------------- 5. concurrency and hangs
def test_trajectory_ids_stay_unique_under_eight_env_threads() -> None:
    envs = [(lambda s=s: arithmetic_env(2, seed=s)) for s in range(8)]
    collector = LLMCollector(
        envs, async_envs=True, policy=ScriptedPolicy("#### 1"), dialog_turns_per_batch=64, total_dialog_turns=256
    )
    ids = [i for batch in collector for i in turn_values(batch, keys.TRAJ_IDS)]
    collector.shutdown()
    assert len(ids) == 256 and len(ids) == len(set(ids))  # every promised turn (tests/unit/test_turn_budget.py)


def test_tracker_hands_out_each_id_once_from_many_threads() -> None:
    tracker = TrajectoryTracker(8, first_id=id_base(3))
    seen: list[int] = []

    def work(slot: int) -> None:
        for _ in range(500):
            traj_id, _, _ = tracker.stamp(slot, 0)
            seen.append(traj_id)
            tracker.end(slot)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(seen) == len(set(seen)) == 4000 and min(seen) >= 3 << 32


def test_pause_returns_at_once_when_the_thread_finished_and_raises_its_error() -> None:
    buffer = ReplayBuffer(capacity=100)
    done = LLMCollector(
        arithmetic_env(2), policy=ScriptedPolicy("1"), dialog_turns_per_batch=2, total_dialog_turns=4, replay_buffer=buffer
    )
    done.start()
    done._background.join(60)
    assert not done._background.is_alive(), "the collector did not finish its 4 turns within 60 s"
    start = time.monotonic()
    with done.pause(timeout_s=120):
        pass
    assert time.monotonic() - start < 60, "pause() waited for its timeout instead of returning at once"

    def broken_reward(history) -> float:
        raise RuntimeError("the judge is down")

    crashed = LLMCollector(
        ChatEnv(arithmetic_dataset(8, seed=0), reward_fn=broken_reward, batch_size=2, seed=0),
        policy=ScriptedPolicy("1"),
        dialog_turns_per_batch=2,
        replay_buffer=ReplayBuffer(capacity=10),
    )
    crashed.start()
    crashed._background.join(60)
    assert not crashed._background.is_alive(), "the crashed collector's thread did not end within 60 s"
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="the judge is down"):
        with crashed.pause(timeout_s=120):
            pass
    assert time.monotonic() - start < 60, "pause() waited for its timeout instead of raising the thread's error"


def test_set_seed_waits_for_the_batch_under_way() -> None:
    gate, entered = threading.Event(), threading.Event()

    class GatedPolicy(ScriptedPolicy):
        def __call__(self, td):
            entered.set()
            gate.wait(10)
            return super().__call__(td)

    collector = LLMCollector(arithmetic_env(2), policy=GatedPolicy("1"), dialog_turns_per_batch=2)
    worker = threading.Thread(target=collector.next)
    worker.start()
    assert entered.wait(10)
    seeder = threading.Thread(target=collector.set_seed, args=(5,))
    seeder.start()
    time.sleep(0.3)
    assert seeder.is_alive(), "set_seed reseeded under a running turn"
    gate.set()
    worker.join(10)
    seeder.join(10)
    assert not seeder.is_alive()


class _NoDoneEnv:
    batch_size = torch.Size([2])

    def __init__(self, drop: str, fail_at_step: int = 0) -> None:
        self.drop, self.fail_at_step, self.steps = drop, fail_at_step, 0

    def reset(self, td=None):
        return lazy_stack([TensorDict({"history": {"prompt": History.from_text("hi")}}) for _ in range(2)])

    def step(self, td):
        self.steps += 1
        nxt = {"reward": torch.zeros(1), "done": torch.zeros(1, dtype=torch.bool), "history": {"prompt": History.from_text("hi")}}
        if self.steps > self.fail_at_step:
            del nxt[self.drop]
        td.set("next", lazy_stack([TensorDict(nxt) for _ in range(2)]))
        return td


@pytest.mark.parametrize("missing", ["done", "reward"])
def test_an_env_without_done_or_reward_is_named(missing: str) -> None:
    collector = LLMCollector(_NoDoneEnv(missing, fail_at_step=1), policy=ScriptedPolicy("1"), dialog_turns_per_batch=4)
    with pytest.raises(ValueError, match=rf"_NoDoneEnv step\(\) returned no \('next', '{missing}'\) at env index 0\.\.1"):
        collector.next()
    assert collector.num_buffered_turns == 2  # the turns of the good step are kept


class _ShortLogProbs(ScriptedPolicy):
    def __call__(self, td):
        out = super().__call__(td)
        bad = out[1]
        bad.set(keys.LOG_PROBS_RESPONSE, bad.get(keys.LOG_PROBS_RESPONSE)[:-1])
        return lazy_stack([out[0], bad])


def test_log_probs_that_do_not_match_the_tokens_are_named() -> None:
    collector = LLMCollector(arithmetic_env(2), policy=_ShortLogProbs("#### 12"), dialog_turns_per_batch=2)
    with pytest.raises(ValueError, match=r"_ShortLogProbs returned \d+ \('log_probs', 'response'\) for \d+ .* at env index 1"):
        collector.next()


# ---------------------------------------------------------------------- 6. updaters and pushes
class _FromPolicyUpdater(LocalWeightUpdater):
    built_from: list = []
    weights = trained()

    @classmethod
    def from_policy(cls, policy):
        cls.built_from.append(policy)
        return cls(cls.weights)


class _NoFromPolicyUpdater(LocalWeightUpdater):
    @classmethod
    def from_policy(cls, policy):
        return None


def test_an_updater_class_is_built_from_the_policy_first() -> None:
    collector = make_collector(weight_updater=_FromPolicyUpdater)
    assert _FromPolicyUpdater.built_from == [collector.policy]
    collector.update_policy_weights_()  # from_policy gave it weights to push
    assert_weights(collector, _FromPolicyUpdater.weights)
    fallback = make_collector(weight_updater=_NoFromPolicyUpdater)
    assert isinstance(fallback.weight_updater, _NoFromPolicyUpdater)
    with pytest.raises(ValueError, match="no weights to push"):
        fallback.update_policy_weights_()


class _WrappingPolicy(nn.Module):
    """A policy module holding the model as ``.model``: its names come out as ``model.*``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model


def test_the_policy_object_itself_can_be_pushed() -> None:
    weights = trained()
    collector = make_collector()
    collector.update_policy_weights_(_WrappingPolicy(weights))
    assert_weights(collector, weights)
    other = make_collector()
    other.receive_weights(policy=_WrappingPolicy(weights))
    assert_weights(other, weights)
    with pytest.raises(ValueError, match="missing"):
        make_collector().update_policy_weights_({"model.embed.weight": torch.zeros(10, 4)})



def test_a_new_updater_continues_from_the_workers_version() -> None:
    collector = make_collector(weight_updater=LocalWeightUpdater(trained()))
    collector.weight_updater.push_weights(version=6)
    collector._weight_updater = None  # the trainer restarts with a fresh updater
    fresh = LocalWeightUpdater(trained())
    collector.weight_updater = fresh
    fresh.push_weights()
    assert collector.policy_version == fresh.version == 7


def test_a_paused_background_collector_can_be_checkpointed(tmp_path) -> None:
    from lmcollect.checkpoint import save_checkpoint

    collector = LLMCollector(
        arithmetic_env(2), policy=ScriptedPolicy("1"), dialog_turns_per_batch=2, replay_buffer=ReplayBuffer(capacity=1000)
    )
    collector.start()
    try:
        outcome: list = []
        with collector.pause(timeout_s=30):
            worker = threading.Thread(target=lambda: outcome.append(save_checkpoint(tmp_path / "ckpt", [collector])))
            worker.start()
            worker.join(20)
            assert not worker.is_alive(), "state_dict() blocked inside pause()"
        assert (tmp_path / "ckpt" / "manifest.json").is_file()
    finally:
        collector.shutdown()


class _RaisingPolicy(ScriptedPolicy):
    def __call__(self, td):
        raise KeyError("the tool server is down")


def test_an_error_from_the_policy_keeps_its_type_and_names_the_env_indices() -> None:
    collector = LLMCollector(arithmetic_env(2), policy=_RaisingPolicy(), dialog_turns_per_batch=2)
    with pytest.raises(KeyError, match="the tool server is down") as info:
        collector.next()
    assert any("_RaisingPolicy at env indices 0..1" in note for note in info.value.__notes__)
