"""lmcollect.compat.torchrl without torchrl installed: what it does to lmcollect's own objects.

torchrl itself is exercised in tests/with_torchrl (`make test-torchrl`).
"""
from __future__ import annotations

import math

import pytest
import torch

from lmcollect.buffers import ReplayBuffer
from lmcollect.collectors import LLMCollector
from lmcollect.collectors.shared.turn_record import next_observation
from lmcollect.compat.torchrl import LOG_PROBS_FULL, TorchrlEnv, is_torchrl_env, to_torchrl_loss_batch
from lmcollect.data import keys
from lmcollect.data.turns import flatten_turns
from lmcollect.training.batch import GroupAdvantage
from tests.factories import make_arithmetic_env, make_ok_policy


def collected(**kwargs):
    collector = LLMCollector(
        make_arithmetic_env(), policy=make_ok_policy(), dialog_turns_per_batch=4, total_dialog_turns=4, **kwargs
    )
    batch = collector.next()
    collector.shutdown()
    return batch


def test_an_lmcollect_env_is_not_a_torchrl_env_and_is_refused_by_the_adapter() -> None:
    env = make_arithmetic_env()
    assert not is_torchrl_env(env)
    with pytest.raises(TypeError, match="env must be a torchrl EnvBase"):
        TorchrlEnv(env)


def test_the_loss_batch_has_full_log_probs_nan_over_the_prompt_and_torchrls_advantage_shape() -> None:
    batch = collected(flatten_data=True, postproc=GroupAdvantage())
    out = to_torchrl_loss_batch(batch)
    assert out.batch_size == torch.Size([4])
    for turn, before in zip(flatten_turns(out), flatten_turns(batch), strict=True):
        full = turn[LOG_PROBS_FULL]
        num_prompt = turn[keys.TOKENS_PROMPT].numel()
        assert full.shape == turn[keys.TOKENS_FULL].shape and full.dtype == torch.float32
        assert torch.isnan(full[:num_prompt]).all()
        assert torch.equal(full[num_prompt:], turn[keys.LOG_PROBS_RESPONSE])
        assert torch.equal(torch.isfinite(full), turn[keys.ASSISTANT_MASK])
        assert turn["advantage"].shape == (1, 1) and before["advantage"].shape == ()
        assert math.isclose(float(turn["advantage"]), float(before["advantage"]))
        assert LOG_PROBS_FULL not in before.keys(True), "the given batch is not changed"


def test_the_loss_batch_names_a_turn_whose_tokens_do_not_add_up() -> None:
    batch = collected(flatten_data=True)
    bad = flatten_turns(batch)[1]
    bad.set(keys.TOKENS_FULL, bad[keys.TOKENS_FULL][:-1])
    with pytest.raises(ValueError, match="turn 1: tokens.full has"):
        to_torchrl_loss_batch(batch)


def test_the_next_observation_leaves_out_every_reward_key_an_env_names() -> None:
    turn = flatten_turns(collected(flatten_data=True))[0]
    nxt = turn["next"].clone()
    nxt.set("reward_answer", torch.ones(1))

    class NamesItsRewards:
        reward_keys = ["reward", "reward_answer"]

    assert "reward_answer" in next_observation(turn, nxt).keys()  # an env naming none: only "reward" leaves
    obs = next_observation(turn, nxt, NamesItsRewards())
    assert not {"reward", "reward_answer"} & set(obs.keys()) and keys.DONE in obs.keys()


def test_batches_for_a_replay_buffer_are_flat_unless_flatten_data_says_otherwise() -> None:
    # torchrl's rule: flatten_data defaults to True when a replay_buffer is given
    assert collected().batch_size == torch.Size([4, 1])
    for flatten_data, flat in ((None, True), (False, False)):
        collector = LLMCollector(
            make_arithmetic_env(), policy=make_ok_policy(), dialog_turns_per_batch=4, total_dialog_turns=4,
            replay_buffer=ReplayBuffer(capacity=8), flatten_data=flatten_data,
        )
        assert collector.config.flatten is flat
        collector.shutdown()
