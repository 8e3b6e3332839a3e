"""GRPO pieces without Ray: advantages, packing, the clipped loss, the warm-up and the demo task."""
from __future__ import annotations

import math

import pytest
import torch
from tensordict import TensorDict

from lmcollect.data.turns import flatten_turns, stack_rows
from lmcollect.envs import PROMPT_ID, comparison_dataset, get_shipped_task
from lmcollect.envs.datasets import row_to_history
from lmcollect.training.batch import LEARNER_KEYS, GroupAdvantage, TrainBatch, train_batch_from_turns
from lmcollect.training.grpo import (
    ADVANTAGE,
    group_advantages,
    pack_turns,
    policy_gradient_loss,
    sft_loss,
    token_log_probs,
)
from lmcollect.training.trainer import GRPOConfig, GRPOLearner
from lmcollect.training.warmup import WarmupConfig, encode_example, warm_up


# ---------------------------------------------------------------------------------------- advantages
def test_group_advantages_normalise_within_each_group() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 5.0, 5.0, 2.0, 4.0])
    groups = torch.tensor([7, 7, 7, 7, 3, 3, 9, 9])
    adv = group_advantages(rewards, groups)
    first = torch.tensor([0.75, -0.25, -0.25, -0.25]) / math.sqrt(0.25)  # unbiased std of [1, 0, 0, 0] is 0.5
    torch.testing.assert_close(adv[:4], first, atol=1e-4, rtol=0)
    torch.testing.assert_close(adv[4:6], torch.zeros(2))  # every answer scored the same: no signal
    torch.testing.assert_close(adv[6:], torch.tensor([-1.0, 1.0]) / math.sqrt(2.0), atol=1e-4, rtol=0)


def test_group_advantages_do_not_depend_on_order_and_can_skip_the_std() -> None:
    rewards = torch.tensor([1.0, 0.0, 3.0, 1.0])
    groups = torch.tensor([0, 1, 0, 1])
    perm = torch.tensor([3, 1, 0, 2])
    torch.testing.assert_close(group_advantages(rewards, groups)[perm], group_advantages(rewards[perm], groups[perm]))
    torch.testing.assert_close(group_advantages(rewards, groups, normalize_std=False), torch.tensor([-1.0, -0.5, 1.0, 0.5]))
    assert group_advantages(torch.tensor([2.0]), torch.tensor([0])).item() == 0.0  # a group of one


def test_group_advantages_reject_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match="1-D of one length"):
        group_advantages(torch.zeros(3), torch.zeros(2))


# ---------------------------------------------------------------------------------------- packing
def test_pack_turns_lays_out_prompt_response_and_behaviour_log_probs() -> None:
    packed = pack_turns(
        [torch.tensor([5, 6, 7]), torch.tensor([8])],
        [torch.tensor([1, 2]), torch.tensor([3, 4, 9])],
        [torch.tensor([-0.1, -0.2]), torch.tensor([-0.3, -0.4, -0.5])],
        pad_token_id=0,
    )
    assert packed.input_ids.tolist() == [[5, 6, 7, 1, 2], [8, 3, 4, 9, 0]]
    assert packed.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    # position j predicts token j + 1: the response tokens of row 0 are tokens 3 and 4
    assert packed.targets_mask.tolist() == [[False, False, True, True], [True, True, True, False]]
    torch.testing.assert_close(packed.old_log_probs[0], torch.tensor([0.0, 0.0, -0.1, -0.2]))
    torch.testing.assert_close(packed.old_log_probs[1], torch.tensor([-0.3, -0.4, -0.5, 0.0]))
    assert packed.num_response_tokens == 5


def test_pack_turns_checks_its_inputs() -> None:
    with pytest.raises(ValueError, match="as many prompts as responses"):
        pack_turns([torch.tensor([1])], [])
    with pytest.raises(ValueError, match="turn 0: 1 log-probs for 2 response tokens"):
        pack_turns([torch.tensor([1])], [torch.tensor([2, 3])], [torch.tensor([0.0])])


def test_training_log_probs_equal_the_collected_ones(tiny_model_and_tokenizer) -> None:
    """The packing's one-token shift lines up with what the policy recorded while generating."""
    from lmcollect.policies import TransformersPolicy

    model, tokenizer = tiny_model_and_tokenizer
    policy = TransformersPolicy(model, tokenizer, max_new_tokens=5, temperature=1.0, seed=0)
    rows = comparison_dataset(6, seed=0)
    prompts, responses, log_probs = policy.generate([row_to_history(r).apply_chat_template(tokenizer) for r in rows])
    packed = pack_turns(prompts, responses, log_probs, pad_token_id=tokenizer.pad_token_id)
    with torch.no_grad():
        recomputed = token_log_probs(model, packed)
    mask = packed.targets_mask
    torch.testing.assert_close(recomputed[mask], packed.old_log_probs[mask], atol=1e-4, rtol=0)


# ---------------------------------------------------------------------------------------- loss
def _one_token_batch(old_log_prob: float) -> object:
    return pack_turns([torch.tensor([1])], [torch.tensor([2])], [torch.tensor([old_log_prob])])


def test_on_policy_loss_is_minus_advantage_times_log_prob_gradient() -> None:
    log_probs = torch.tensor([[-0.7, -1.2]], requires_grad=True)
    packed = pack_turns([torch.tensor([1])], [torch.tensor([2, 3])], [torch.tensor([-0.7, -1.2])])
    loss, metrics = policy_gradient_loss(log_probs, packed, torch.tensor([2.0]))
    loss.backward()
    torch.testing.assert_close(log_probs.grad, torch.tensor([[-1.0, -1.0]]))  # -A / num_tokens per token
    assert metrics["loss/clip_fraction"] == 0.0 and abs(metrics["loss/approx_kl"]) < 1e-6


@pytest.mark.parametrize(("log_ratio", "advantage", "clipped"), [(0.5, 1.0, True), (0.5, -1.0, False), (-0.5, -1.0, True), (-0.5, 1.0, False)])
def test_the_importance_ratio_is_clipped_only_where_ppo_clips_it(log_ratio: float, advantage: float, clipped: bool) -> None:
    old = -1.0
    log_probs = torch.tensor([[old + log_ratio]], requires_grad=True)
    loss, metrics = policy_gradient_loss(log_probs, _one_token_batch(old), torch.tensor([advantage]), clip_epsilon=0.2)
    loss.backward()
    assert metrics["loss/clip_fraction"] == 1.0
    if clipped:  # moving further out of the trust region earns nothing
        assert log_probs.grad.item() == 0.0
    else:
        assert log_probs.grad.item() == pytest.approx(-advantage * math.exp(log_ratio))


def test_padding_does_not_change_the_loss() -> None:
    packed = pack_turns([torch.tensor([1])], [torch.tensor([2, 3])], [torch.tensor([-0.5, -0.5])])
    padded = pack_turns([torch.tensor([1]), torch.tensor([1, 1, 1, 1])], [torch.tensor([2, 3]), torch.tensor([4])],
                        [torch.tensor([-0.5, -0.5]), torch.tensor([-0.5])])
    lp = torch.full((1, 2), -0.4)
    lp_padded = torch.full((2, 4), -0.4)
    loss, _ = policy_gradient_loss(lp, packed, torch.tensor([1.0]))
    loss_padded, _ = policy_gradient_loss(lp_padded, padded, torch.tensor([1.0, 1.0]))
    assert loss.item() == pytest.approx(loss_padded.item())
    with pytest.raises(ValueError, match="advantages must have shape"):
        policy_gradient_loss(lp, packed, torch.tensor([1.0, 2.0]))


def test_sft_loss_is_the_mean_response_nll() -> None:
    packed = pack_turns([torch.tensor([1, 1])], [torch.tensor([2, 3])])
    log_probs = torch.tensor([[-9.0, -1.0, -3.0]])  # the first position predicts a prompt token: ignored
    assert sft_loss(log_probs, packed).item() == pytest.approx(2.0)


# ---------------------------------------------------------------------------------------- learning
def test_grpo_steps_make_the_rewarded_answer_more_likely(tiny_model_and_tokenizer) -> None:
    """Half the group answers 7 (reward 1), half something else (reward 0): 7 becomes more likely."""
    from lmcollect.models import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(tiny_model_and_tokenizer[0].name_or_path)  # a copy: the fixture is shared
    seven = tokenizer("7", add_special_tokens=False)["input_ids"][0]
    text = row_to_history({"prompt": "Which is larger, 3 or 7?"}).apply_chat_template(tokenizer)
    prompt = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"])
    learner = GRPOLearner(model, GRPOConfig(lr=3e-3))
    torch.manual_seed(0)

    def next_token_probs() -> torch.Tensor:
        with torch.no_grad():
            return model(input_ids=prompt[None]).logits[0, -1].softmax(-1)

    before = next_token_probs()[seven].item()
    for _ in range(5):
        probs = next_token_probs()
        probs[seven] = 0.0
        others = torch.multinomial(probs, 8, replacement=True)
        responses = [torch.tensor([seven])] * 8 + [t[None] for t in others]
        rewards = torch.tensor([1.0] * 8 + [0.0] * 8)
        old = [torch.log(next_token_probs()[r]) for r in responses]  # the behaviour policy is the current one
        packed = pack_turns([prompt] * 16, responses, old)
        batch = TrainBatch(packed=packed, advantages=group_advantages(rewards, torch.zeros(16)), rewards=rewards,
                           policy_versions=torch.zeros(16, dtype=torch.long))
        metrics = learner.train_step(batch)
    assert next_token_probs()[seven].item() > 2 * before
    assert metrics["loss/grad_norm"] > 0


def test_warm_up_lowers_the_loss_and_teaches_the_format(tiny_model_and_tokenizer) -> None:
    from lmcollect.models import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(tiny_model_and_tokenizer[0].name_or_path)
    rows = comparison_dataset(256, seed=0)
    prompt, answer = encode_example(rows[0], tokenizer)
    assert answer[-1].item() == tokenizer.eos_token_id and tokenizer.decode(answer[:-1]) == rows[0]["answer"]
    losses = warm_up(model, tokenizer, rows, WarmupConfig(num_steps=30, batch_size=16))
    assert len(losses) == 30 and sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5
    assert not model.training
    with pytest.raises(ValueError, match="has no 'answer'"):
        encode_example({"prompt": "hi"}, tokenizer)


def test_warmup_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="num_steps"):
        WarmupConfig(num_steps=-1)
    with pytest.raises(ValueError, match="lr"):
        GRPOConfig(lr=0)


# ---------------------------------------------------------------------------------------- turns -> batch
def _turn(prompt_id: int, reward: float, version: int) -> TensorDict:
    return TensorDict(
        {
            "tokens": {"prompt": torch.tensor([1, 2]), "response": torch.tensor([3])},
            "log_probs": {"response": torch.tensor([-0.5])},
            "next": {"reward": torch.tensor([reward])},
            "env": {"prompt_id": torch.tensor(prompt_id)},
            "collector": {"traj_ids": torch.tensor(prompt_id * 10)},
            "policy_version": torch.tensor(version),
            "text": {"prompt": "dropped by keep_keys"},
        },
        batch_size=[],
    )


def test_group_advantage_postproc_writes_advantages_and_keeps_the_learner_keys() -> None:
    batch = stack_rows([[_turn(0, 1.0, 3)], [_turn(0, 0.0, 3)], [_turn(1, 1.0, 4)], [_turn(1, 1.0, 4)]])  # (num_envs, T)
    out = GroupAdvantage(keep_keys=LEARNER_KEYS)(batch)
    turns = flatten_turns(out)
    assert [round(t.get(ADVANTAGE).item(), 3) for t in turns] == [0.707, -0.707, 0.0, 0.0]
    assert ("text", "prompt") not in turns[0].keys(include_nested=True)
    assert PROMPT_ID in turns[0].keys(include_nested=True)
    train = train_batch_from_turns(out, pad_token_id=0)
    assert train.rewards.tolist() == [1.0, 0.0, 1.0, 1.0] and train.policy_versions.tolist() == [3, 3, 4, 4]
    assert train.packed.input_ids.shape == (4, 3)


def test_train_batch_needs_advantages() -> None:
    with pytest.raises(KeyError, match="GroupAdvantage"):
        train_batch_from_turns(stack_rows([[_turn(0, 1.0, 0)]]), pad_token_id=0)


# ---------------------------------------------------------------------------------------- the demo task
def test_comparison_rows_ask_for_the_larger_of_two_distinct_digits() -> None:
    rows = comparison_dataset(200, seed=3)
    assert rows == comparison_dataset(200, seed=3)
    for row in rows:
        a, b = (int(x) for x in row["prompt"].removeprefix("Which is larger, ").removesuffix("?").split(" or "))
        assert a != b and 0 <= min(a, b) and max(a, b) <= 9 and row["answer"] == str(max(a, b))
    with pytest.raises(ValueError, match="max_value"):
        comparison_dataset(3, seed=0, max_value=0)


def test_the_comparison_warm_up_answers_are_right_only_by_chance() -> None:
    import random

    task = get_shipped_task("comparison")
    rng = random.Random(0)
    row = {"prompt": "Which is larger, 3 or 7?", "answer": "7"}
    assert {task.format_answer(row, rng) for _ in range(50)} == {"3", "7"}
    rows = task.make_rows(400, seed=0)
    right = sum(task.format_answer(r, rng) == r["answer"] for r in rows) / len(rows)
    assert 0.4 < right < 0.6


def test_shipped_tasks_score_their_own_reference_answers() -> None:
    import random

    for name in ("comparison", "addition", "arithmetic"):
        task = get_shipped_task(name)
        row = task.make_rows(1, seed=0)[0]
        state = task.make_task().start(row, random.Random(0))
        history = row_to_history(row).append("assistant", row["answer"])
        assert task.make_task().respond(state, history).reward == 1.0, name
    with pytest.raises(ValueError, match="unknown task 'nope'; shipped tasks: comparison"):
        get_shipped_task("nope")


def test_per_dialog_advantages_give_every_turn_its_dialogs_normalised_return() -> None:
    from tensordict import TensorDict

    from lmcollect.data import keys
    from lmcollect.data.turns import flatten_turns, stack_turns
    from lmcollect.training.batch import GroupAdvantage
    from lmcollect.training.grpo import ADVANTAGE

    # group 7: dialog 1 (two turns, return 1), dialog 2 (one turn, return 0); group 8: dialog 3 alone
    spec = [(7, 1, 0.0), (7, 1, 1.0), (7, 2, 0.0), (8, 3, 1.0)]
    turns = [
        TensorDict({keys.GROUP_ID: torch.tensor(g), keys.TRAJ_IDS: torch.tensor(t), keys.NEXT_REWARD: torch.tensor([r])}, [])
        for g, t, r in spec
    ]
    out = flatten_turns(GroupAdvantage(per_dialog=True, normalize_std=False)(stack_turns(turns)))
    assert [float(t[ADVANTAGE]) for t in out] == [0.5, 0.5, -0.5, 0.0]
    with pytest.raises(ValueError, match="drop group_size"):
        GroupAdvantage(per_dialog=True, group_size=4)
