"""torchrl 0.14.1 itself next to lmcollect (`make test-torchrl`): a torchrl user's env, buffer and loss work.

A torchrl ChatEnv with its transforms is collected as it is by lmcollect's collectors over lmcollect's
engines; the batches go into torchrl's own ReplayBuffer and come back the same; torchrl's GRPOLoss
(over its TransformersWrapper of the same model) reads them, and before any update it recomputes the
recorded log-probs (log-ratio 0) on the same tokens and masks; and a RayLLMCollector takes the
arguments of torchrl's documentation page.
"""
from __future__ import annotations

import functools
import math
import os
from pathlib import Path

import pytest
import torch

torchrl = pytest.importorskip("torchrl")

from torchrl.data import LazyStackStorage, ReplayBuffer  # noqa: E402

from lmcollect.collectors import ContinuousLLMCollector, LLMCollector  # noqa: E402
from lmcollect.compat.torchrl import LOG_PROBS_FULL, TorchrlEnv, to_torchrl_loss_batch  # noqa: E402
from lmcollect.data import History, keys  # noqa: E402
from lmcollect.data.turns import flatten_turns, non_tensor_values  # noqa: E402
from lmcollect.engines import TransformersEngine  # noqa: E402
from lmcollect.engines.sampling import SamplingConfig  # noqa: E402
from lmcollect.training.batch import GroupAdvantage  # noqa: E402
from tests.with_torchrl.torchrl_factories import MAX_STEPS, make_one_dialog_env, make_policy, make_torchrl_env  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[2]
REWARD_PARTS = ("reward_answer", "reward_think", "reward_right", "success")  # GSM8KRewardParser's reward keys


def test_the_installed_torchrl_is_the_one_tested() -> None:
    import tensordict

    assert torchrl.__version__ == "0.14.1" and tensordict.__version__.startswith("0.14.")
    assert torch.version.cuda is None, "the torchrl environment must keep the CPU build of torch"


def check_dialogs(turns: list) -> None:
    """Every dialog ran MAX_STEPS turns (StepCounter), scored by the parser, with lmcollect histories."""
    by_traj: dict[int, list] = {}
    for turn in turns:
        by_traj.setdefault(int(turn[keys.TRAJ_IDS]), []).append(turn)
        assert isinstance(non_tensor_values(turn, keys.HISTORY_FULL)[0], History)
        assert turn[keys.NEXT_REWARD].shape == (1, 1), "the reward keeps the parser's shape"
        assert all(("next", part) in turn.keys(True) for part in REWARD_PARTS)
        assert not any(part in turn.keys() for part in REWARD_PARTS), "a reward entry leaked into the observation"
    for dialog in by_traj.values():
        dialog.sort(key=lambda t: int(t[keys.STEP_COUNT]))
        assert [int(t[keys.STEP_COUNT]) for t in dialog] == list(range(len(dialog)))
        assert [int(t["next", "step_count"]) for t in dialog] == list(range(1, len(dialog) + 1)), "StepCounter's count"
        done = [bool(t[keys.NEXT_DONE].any()) for t in dialog]
        assert done[:-1] == [False] * (len(dialog) - 1)
        if done[-1]:
            assert len(dialog) == MAX_STEPS and bool(dialog[-1][keys.NEXT_TRUNCATED].any())


def test_llm_collector_runs_a_torchrl_chat_env_as_it_is(tiny_model_path) -> None:
    env = make_torchrl_env(num_envs=2)
    collector = LLMCollector(
        env, policy=make_policy(str(tiny_model_path)), dialog_turns_per_batch=4, total_dialog_turns=8
    )
    assert isinstance(collector.env, TorchrlEnv) and collector.env.env is env
    batches = list(collector)
    collector.shutdown()
    assert [b.batch_size for b in batches] == [torch.Size([2, 2])] * 2 and collector.turns_counted == 8
    turns = [t for b in batches for t in flatten_turns(b)]
    check_dialogs(turns)
    # the second turn of a dialog answers the torchrl env's next prompt: the first full history
    first, second = turns[0], turns[1]
    assert non_tensor_values(second, keys.HISTORY_PROMPT)[0] == non_tensor_values(first, keys.HISTORY_FULL)[0]
    assert str(non_tensor_values(first, "query")[0]) == "What is 0 + 0?"


def test_continuous_collector_runs_torchrl_chat_envs_over_a_transformers_engine(tiny_model_and_tokenizer) -> None:
    model, tokenizer = tiny_model_and_tokenizer
    engine = TransformersEngine(model, tokenizer)
    collector = ContinuousLLMCollector(
        make_one_dialog_env, engine=engine, tokenizer=tokenizer, sampling=SamplingConfig(max_new_tokens=8),
        max_dialogs_in_flight=2, dialog_turns_per_batch=4, total_dialog_turns=8,
        yield_completed_trajectories=True,
    )
    try:
        batches = list(collector)
    finally:
        collector.shutdown()
        engine.close()
    turns = [t for b in batches for t in flatten_turns(b)]
    assert len(turns) == collector.turns_counted == collector.turns_run >= 8
    check_dialogs(turns)
    assert all(bool(t[keys.NEXT_DONE].any()) == (int(t[keys.STEP_COUNT]) == MAX_STEPS - 1) for t in turns)


def turn_ids(turns) -> list[tuple[int, int]]:
    return sorted((int(t[keys.TRAJ_IDS]), int(t[keys.STEP_COUNT])) for t in turns)


def test_lmcollect_batches_go_into_torchrls_replay_buffer_and_come_back(tiny_model_path) -> None:
    policy = make_policy(str(tiny_model_path))
    collector = LLMCollector(make_torchrl_env(), policy=policy, dialog_turns_per_batch=4, total_dialog_turns=8)
    batches = list(collector)
    collector.shutdown()
    written = [t for b in batches for t in flatten_turns(b)]
    buffer = ReplayBuffer(storage=LazyStackStorage(64))
    for batch in batches:
        buffer.extend(batch.reshape(-1))
    assert len(buffer) == 8
    back = {(int(t[keys.TRAJ_IDS]), int(t[keys.STEP_COUNT])): t for t in flatten_turns(buffer[:])}
    assert sorted(back) == turn_ids(written)
    for turn in written:
        stored = back[int(turn[keys.TRAJ_IDS]), int(turn[keys.STEP_COUNT])]
        for key in (keys.TOKENS_FULL, keys.LOG_PROBS_RESPONSE, keys.ASSISTANT_MASK, keys.NEXT_REWARD):
            assert torch.equal(stored[key], turn[key]), key
        assert non_tensor_values(stored, keys.HISTORY_FULL) == non_tensor_values(turn, keys.HISTORY_FULL)
    sample = buffer.sample(4)
    assert sample.batch_size == torch.Size([4])
    # a collector writes into it too (flat turns, as with torchrl's collectors)
    into = ReplayBuffer(storage=LazyStackStorage(64))
    writer = LLMCollector(
        make_torchrl_env(), policy=policy, dialog_turns_per_batch=4, total_dialog_turns=8, replay_buffer=into
    )
    assert list(writer) == [None, None] and len(into) == 8
    writer.shutdown()


@pytest.fixture(scope="module")
def loss_batch(tiny_model_path):
    """A batch of 8 turns with GRPO advantages, as torchrl's losses read it."""
    collector = LLMCollector(
        make_torchrl_env(num_envs=4), policy=make_policy(str(tiny_model_path)), dialog_turns_per_batch=8,
        total_dialog_turns=8, flatten_data=True, postproc=GroupAdvantage(),
    )
    batch = collector.next()
    collector.shutdown()
    return batch


def grpo_loss(model, tokenizer, masking_strategy: str):
    from torchrl.modules.llm import TransformersWrapper
    from torchrl.objectives.llm import GRPOLoss

    wrapper = TransformersWrapper(
        model, tokenizer=tokenizer, input_mode="tokens", generate=False, return_log_probs=True, pad_output=False
    )
    return GRPOLoss(wrapper, masking_strategy=masking_strategy)


def test_torchrls_grpo_loss_reads_an_lmcollect_batch(loss_batch, tiny_model_and_tokenizer) -> None:
    model, tokenizer = tiny_model_and_tokenizer
    batch = to_torchrl_loss_batch(loss_batch)
    assert LOG_PROBS_FULL not in loss_batch[0].keys(True), "the collected batch is not changed"
    model.zero_grad()
    out = grpo_loss(model, tokenizer, "sft")(batch)
    total = out.loss_objective + out.loss_entropy
    assert torch.isfinite(total) and total.ndim == 0
    total.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads) and any(g.abs().sum() > 0 for g in grads)
    model.zero_grad()
    # no update yet: the recorded log-probs are the loss's own, so every importance ratio is 1
    assert float(out.clip_fraction) == 0.0
    assert math.isclose(float(out.ESS), 1.0, abs_tol=1e-4) and abs(float(out.kl_approx)) < 1e-5


def test_the_loss_recomputes_the_recorded_log_probs_on_the_same_tokens_and_masks(
    loss_batch, tiny_model_and_tokenizer
) -> None:
    model, tokenizer = tiny_model_and_tokenizer
    batch = to_torchrl_loss_batch(loss_batch)
    loss = grpo_loss(model, tokenizer, "sft")
    with torch.no_grad():
        recomputed = loss.actor_network(batch.copy()).get(LOG_PROBS_FULL, as_list=True)
    for turn, now in zip(flatten_turns(batch), recomputed, strict=True):
        recorded = turn[LOG_PROBS_FULL]
        sampled = torch.isfinite(recorded)  # the response: NaN over the prompt
        assert now.shape == recorded.shape == turn[keys.TOKENS_FULL].shape
        assert torch.equal(sampled, turn[keys.ASSISTANT_MASK]), "the response is what the assistant mask marks"
        assert int(sampled.sum()) == turn[keys.TOKENS_RESPONSE].numel()
        log_ratio = now[sampled] - recorded[sampled]
        assert log_ratio.abs().max() < 1e-4, f"log-ratio {log_ratio.abs().max():.2e} before any update"
    # the assistant mask (rlhf) and the prompt mask (sft) select the same tokens: the same loss
    sft, rlhf = (grpo_loss(model, tokenizer, strategy)(batch) for strategy in ("sft", "rlhf"))
    assert torch.allclose(sft.loss_objective, rlhf.loss_objective, atol=1e-6)


@pytest.fixture
def ray_session():
    yield
    import ray

    ray.shutdown()


def test_a_ray_collector_takes_the_torchrl_spec_pages_arguments(tiny_model_path, ray_session) -> None:
    from lmcollect.ray import RayLLMCollector

    # the keyword arguments of torchrl's RayLLMCollector page, and its sync_iter example (iterate)
    pythonpath = os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])
    collector = RayLLMCollector(
        make_torchrl_env,
        policy_factory=functools.partial(make_policy, str(tiny_model_path)),
        dialog_turns_per_batch=4,
        total_dialog_turns=8,
        yield_only_last_steps=None,
        yield_completed_trajectories=None,
        postproc=None,
        async_envs=None,
        replay_buffer=None,
        reset_at_each_iter=False,
        flatten_data=True,
        weight_updater=None,
        ray_init_config={"num_cpus": 2, "runtime_env": {"env_vars": {"PYTHONPATH": pythonpath}}},
        remote_config={"num_cpus": 1},
        track_policy_version=True,
        sync_iter=False,
        verbose=False,
        num_cpus=1,
        num_gpus=None,
    )
    try:
        batches = list(collector)
        assert [b.batch_size for b in batches] == [torch.Size([4])] * 2
        assert collector.total_dialog_turns == 8 and collector.dialog_turns_per_batch == 4
        assert collector.turns_counted == 8 and collector.get_policy_version() == 0
        check_dialogs([t for b in batches for t in flatten_turns(b)])
    finally:
        collector.shutdown()
