"""One contract suite run against LLMCollector and RayLLMCollector: same API, same behaviour."""
from __future__ import annotations

import time

import pytest
import torch

from lmcollect.buffers import ReplayBuffer
from lmcollect.collectors import LLMCollector
from lmcollect.data import keys
from lmcollect.data.turns import flatten_turns
from lmcollect.testing import ScriptedPolicy

from tests.factories import make_guesser, make_guessing_env

pytestmark = pytest.mark.integration

make_env, make_policy = make_guessing_env, make_guesser


@pytest.fixture(params=["local", "ray"])
def make_collector(request):
    created = []

    def build(**kwargs):
        kwargs.setdefault("dialog_turns_per_batch", 4)
        if request.param == "local":
            collector = LLMCollector(make_env, policy_factory=make_policy, **kwargs)
        else:
            request.getfixturevalue("ray_cluster")
            from lmcollect.ray.collector import RayLLMCollector

            collector = RayLLMCollector(make_env, policy_factory=make_policy, num_cpus=0.25, **kwargs)
        created.append(collector)
        return collector

    build.kind = request.param
    yield build
    for collector in created:
        collector.shutdown()


def test_finite_iteration_and_stop(make_collector) -> None:
    collector = make_collector(total_dialog_turns=12)
    batches = list(collector)
    assert [b.batch_size for b in batches] == [torch.Size([2, 2])] * 3
    with pytest.raises(StopIteration, match="total_dialog_turns=12"):
        collector.next()


@pytest.mark.parametrize(
    "kwargs, shape",
    [
        ({"flatten_data": True}, torch.Size([4])),
        ({"yield_only_last_steps": True}, torch.Size([4])),
    ],
)
def test_batch_shapes(make_collector, kwargs, shape) -> None:
    assert make_collector(**kwargs).next().batch_size == shape


def test_completed_trajectories(make_collector) -> None:
    batch = make_collector(yield_completed_trajectories=True).next()
    turns = flatten_turns(batch)
    assert bool(turns[-1][keys.NEXT_DONE]) and batch.numel() >= 4
    assert float(turns[-1][keys.NEXT_REWARD]) == 1.0


def test_properties(make_collector) -> None:
    collector = make_collector(total_dialog_turns=40, track_policy_version=True)
    assert collector.dialog_turns_per_batch == 4
    assert collector.total_dialog_turns == 40
    assert collector.policy_version == 0 and collector.get_policy_version() == 0
    assert collector.weight_updater is None
    assert collector.is_initialized()
    with pytest.raises(RuntimeError, match="worker_idx"):
        collector.worker_idx
    collector.worker_idx = 3
    assert collector.worker_idx == 3
    assert int(collector.next()[0, 0][keys.TRAJ_IDS]) >= 3 << 32  # worker ranges keep ids unique
    assert collector.rollout().batch_size == torch.Size([2, 2])


def test_versions_through_increment(make_collector) -> None:
    collector = make_collector(track_policy_version=True)
    assert set(collector.next()[keys.POLICY_VERSION].flatten().tolist()) == {0}
    collector.increment_version()
    assert collector.policy_version == 1
    assert set(collector.next()[keys.POLICY_VERSION].flatten().tolist()) == {1}


def test_env_policy_and_model_access(make_collector) -> None:
    collector = make_collector()
    assert collector.getattr_env("batch_size") == torch.Size([2])
    assert collector.getattr_policy("num_calls") == 0
    assert isinstance(collector.get_policy_model(), ScriptedPolicy)
    assert isinstance(collector.get_model("policy"), ScriptedPolicy)
    with pytest.raises(ValueError, match="unknown model_id"):
        collector.get_model("critic")
    with pytest.raises(AttributeError, match="replay_buffer"):
        collector.getattr_rb("capacity")


def test_seed_state_and_reset(make_collector) -> None:
    first = make_collector()
    assert first.set_seed(7) == 8
    a = [t[keys.TEXT_PROMPT] for t in flatten_turns(first.next())]
    second = make_collector()
    second.set_seed(7)
    assert [t[keys.TEXT_PROMPT] for t in flatten_turns(second.next())] == a
    state = first.state_dict()
    assert {"policy_state_dict", "env_state_dict"} <= set(state)
    first.next()
    for collector in (first, second):  # both restart their dialogs from the saved env state
        collector.load_state_dict(state)
    assert [t[keys.TEXT_PROMPT] for t in flatten_turns(second.next())] == [
        t[keys.TEXT_PROMPT] for t in flatten_turns(first.next())
    ]
    first.reset()
    assert first.next()[keys.STEP_COUNT][:, 0].tolist() == [0, 0]


def test_cascade_execute_and_receive_weights_errors(make_collector) -> None:
    collector = make_collector()
    assert collector.cascade_execute("env.batch_size.numel") == 2
    with pytest.raises(ValueError, match="only one"):
        collector.receive_weights({"w": torch.zeros(1)}, policy={"w": torch.zeros(1)})
    with pytest.raises(RuntimeError, match="no weight_updater"):
        collector.init_updater()


def test_replay_buffer_iteration_yields_none(make_collector) -> None:
    buffer = ReplayBuffer(capacity=100)
    collector = make_collector(replay_buffer=buffer, total_dialog_turns=8)
    assert list(collector) == [None, None]
    assert collector.getattr_rb("write_count") == 8  # the buffer the collector writes to


def test_start_pause_shutdown(make_collector) -> None:
    buffer = ReplayBuffer(capacity=10_000)
    collector = make_collector(replay_buffer=buffer)
    collector.start()
    deadline = time.monotonic() + 60
    while collector.getattr_rb("write_count") < 8 and time.monotonic() < deadline:
        time.sleep(0.05)
    with collector.pause():
        frozen = collector.getattr_rb("write_count")
        time.sleep(0.3)
        assert collector.getattr_rb("write_count") == frozen
    deadline = time.monotonic() + 60
    while collector.getattr_rb("write_count") == frozen and time.monotonic() < deadline:
        time.sleep(0.05)
    assert collector.getattr_rb("write_count") > frozen
    collector.shutdown()
    collector.shutdown()
    assert not collector.is_initialized()


def test_a_torchrl_shaped_env_passes_through_both_collectors(make_collector, request) -> None:
    from lmcollect.ray.collector import RayLLMCollector
    from tests.factories import TorchrlShapedEnv, make_ok_policy

    kwargs = {"policy_factory": make_ok_policy, "dialog_turns_per_batch": 4, "yield_completed_trajectories": True}
    if make_collector.kind == "local":
        collector = LLMCollector(TorchrlShapedEnv, **kwargs)
    else:
        collector = RayLLMCollector(TorchrlShapedEnv, num_cpus=0.25, **kwargs)
    try:
        turns = flatten_turns(collector.next())
    finally:
        collector.shutdown()
    assert len(turns) == 4 and [int(t[keys.STEP_COUNT]) for t in turns] == [0, 1, 0, 1]
    assert all(float(t[keys.NEXT_REWARD]) == 1.0 for t in turns)
    assert [bool(t[keys.NEXT_DONE]) for t in turns] == [False, True, False, True]
    # the second turn's prompt holds the first turn's answer and the env's reply
    second = turns[1]
    assert [m.content for m in second.get_non_tensor(keys.HISTORY_PROMPT).messages][-2:] == ["ok", "again"]
