"""Batches packed for the trip between processes come back equal: keys, values, dtypes, nesting."""
from __future__ import annotations

import pickle

import pytest
import torch
from tensordict import NonTensorData, TensorDict

from lmcollect.collectors import LLMCollector
from lmcollect.data.packed_turns import PackedTurns, pack, unpack
from lmcollect.data.turns import flatten_turns
from lmcollect.envs import ChatEnv, GuessingGameTask, guessing_game_dataset
from lmcollect.testing import ScriptedPolicy


def collected(**kwargs):
    env = ChatEnv(guessing_game_dataset(32, seed=0), task=GuessingGameTask(low=1, high=20, max_turns=4), batch_size=3, seed=0)
    collector = LLMCollector(env, policy=ScriptedPolicy("7"), dialog_turns_per_batch=6, track_policy_version=True, **kwargs)
    return collector.next()


def assert_identical(a, b) -> None:
    assert type(a) is type(b) and a.batch_size == b.batch_size
    for ta, tb in zip(flatten_turns(a), flatten_turns(b), strict=True):
        assert sorted(map(str, ta.keys(True, True))) == sorted(map(str, tb.keys(True, True)))
        for key in ta.keys(True, True):
            va, vb = ta.get(key), tb.get(key)
            assert type(va) is type(vb), key
            if isinstance(va, torch.Tensor):
                assert va.dtype == vb.dtype and va.shape == vb.shape and torch.equal(va, vb), key
            else:
                assert va.data == vb.data, key


@pytest.mark.parametrize("options", [{}, {"yield_completed_trajectories": True}])
def test_a_packed_batch_round_trips_through_pickle_unchanged(options) -> None:
    batch = collected(**options)
    packed = pack(batch)
    assert isinstance(packed, PackedTurns)
    back = pickle.loads(pickle.dumps(packed))  # unpickled, it is the batch again
    assert_identical(back, batch)
    assert_identical(unpack(packed), batch)  # in the same process
    for turn in flatten_turns(back):  # the trainer may write into what it received
        turn.get(("tokens", "response")).add_(0)


def test_what_it_cannot_describe_travels_consolidated_or_unchanged() -> None:
    dense = TensorDict({"a": torch.arange(6).reshape(3, 2), "b": {"c": torch.ones(3)}}, batch_size=[3])
    packed = pack(dense)
    assert not isinstance(packed, PackedTurns) and packed.is_consolidated()
    assert (unpack(pickle.loads(pickle.dumps(packed))) == dense).all()
    assert pack(None) is None and unpack(None) is None
    one = TensorDict({"x": torch.zeros(0, dtype=torch.int64), "note": NonTensorData("hi")}, batch_size=[])
    assert_identical(unpack(pack(one)), one)  # empty tensors and a bare turn
