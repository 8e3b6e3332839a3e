"""TransformersPolicy on the real tiny model: layout, log-probs, padding, sampling and seeds."""
from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict, lazy_stack

from lmcollect.collectors import LLMCollector
from lmcollect.data import History, keys
from lmcollect.data.turns import flatten_turns
from lmcollect.envs import ChatEnv, MathAnswerReward, arithmetic_dataset
from lmcollect.engines.hf.generate import response_lengths
from lmcollect.policies import SamplingConfig, TransformersPolicy


def prompts_td(texts: list[str]) -> TensorDict:
    return lazy_stack([TensorDict({"history": {"prompt": History.from_text(t)}}, batch_size=[]) for t in texts])


@pytest.fixture
def policy(tiny_model_and_tokenizer) -> TransformersPolicy:
    model, tokenizer = tiny_model_and_tokenizer
    return TransformersPolicy(model, tokenizer, max_new_tokens=12, temperature=1.0, seed=0)


def forward_log_probs(model, turn) -> torch.Tensor:
    ids = turn[keys.TOKENS_FULL].unsqueeze(0)
    with torch.no_grad():
        logits = model(ids).logits.float()
    log_probs = logits.log_softmax(-1)[0, :-1].gather(-1, ids[0, 1:, None]).squeeze(-1)
    return log_probs[-turn[keys.TOKENS_RESPONSE].numel() :]


def test_output_layout(policy: TransformersPolicy) -> None:
    out = policy(prompts_td(["What is 1 + 1?", "A much longer question about numbers and words?"]))
    assert out.batch_size == torch.Size([2])
    for turn in flatten_turns(out):
        n_prompt, n_resp = turn[keys.TOKENS_PROMPT].numel(), turn[keys.TOKENS_RESPONSE].numel()
        assert torch.equal(turn[keys.TOKENS_FULL], torch.cat([turn[keys.TOKENS_PROMPT], turn[keys.TOKENS_RESPONSE]]))
        assert turn[keys.ATTENTION_MASK].all() and turn[keys.ATTENTION_MASK].numel() == n_prompt + n_resp
        assert turn[keys.ASSISTANT_MASK].sum() == n_resp and not turn[keys.ASSISTANT_MASK][:n_prompt].any()
        assert turn[keys.LOG_PROBS_RESPONSE].shape == (n_resp,)
        assert turn[keys.HISTORY_FULL].messages[-1].role == "assistant"
        assert turn[keys.HISTORY_FULL].messages[-1].content == turn[keys.TEXT_RESPONSE]
        assert turn[keys.TEXT_FULL] == turn[keys.TEXT_PROMPT] + turn[keys.TEXT_RESPONSE]
        # prompt tokens are exactly the rendered chat template, without left padding
        assert turn[keys.TEXT_PROMPT].endswith("<|im_start|>assistant\n")
        assert turn[keys.TOKENS_PROMPT][0] != policy.tokenizer.pad_token_id


def test_log_probs_equal_forward_pass(policy: TransformersPolicy) -> None:
    out = policy(prompts_td(["What is 3 + 4?", "Guess a number from 1 to 20, please, quickly.", "Hi"]))
    for turn in flatten_turns(out):
        torch.testing.assert_close(turn[keys.LOG_PROBS_RESPONSE], forward_log_probs(policy.model, turn), atol=1e-4, rtol=0)


def test_greedy_is_deterministic_and_matches_argmax(tiny_model_and_tokenizer) -> None:
    model, tokenizer = tiny_model_and_tokenizer
    policy = TransformersPolicy(model, tokenizer, max_new_tokens=8, temperature=0)
    first = policy(prompts_td(["What is 2 + 2?"]))
    second = policy(prompts_td(["What is 2 + 2?"]))
    assert torch.equal(first[0][keys.TOKENS_RESPONSE], second[0][keys.TOKENS_RESPONSE])
    turn = first[0]
    with torch.no_grad():
        logits = model(turn[keys.TOKENS_FULL].unsqueeze(0)).logits[0]
    n = turn[keys.TOKENS_RESPONSE].numel()
    assert torch.equal(logits[-n - 1 : -1].argmax(-1), turn[keys.TOKENS_RESPONSE])


def test_same_seed_same_samples(tiny_model_and_tokenizer) -> None:
    model, tokenizer = tiny_model_and_tokenizer
    texts = ["What is 5 + 6?", "What is 9 - 3?"]

    def sample(seed: int) -> list[list[int]]:
        policy = TransformersPolicy(model, tokenizer, max_new_tokens=10, temperature=1.0, seed=seed)
        return [t[keys.TOKENS_RESPONSE].tolist() for t in flatten_turns(policy(prompts_td(texts)))]

    assert sample(1) == sample(1)
    assert sample(1) != sample(2)


def test_collector_set_seed_reproduces_sampled_data(tiny_model_and_tokenizer) -> None:
    model, tokenizer = tiny_model_and_tokenizer

    def run(seed: int) -> list[str]:
        env = ChatEnv(arithmetic_dataset(32, seed=0), reward_fn=MathAnswerReward(), batch_size=3)
        collector = LLMCollector(env, policy=TransformersPolicy(model, tokenizer, max_new_tokens=8), dialog_turns_per_batch=3)
        collector.set_seed(seed)
        return [t[keys.TEXT_FULL] for t in flatten_turns(collector.next())]

    assert run(5) == run(5)
    assert run(5) != run(6)


def test_pad_id_tokens_are_kept(tiny_model_and_tokenizer) -> None:
    """A generated token equal to the pad id is real output; only tokens after eos are dropped."""
    model, tokenizer = tiny_model_and_tokenizer
    policy = TransformersPolicy(model, tokenizer, max_new_tokens=6, temperature=0)
    pad, eos = tokenizer.pad_token_id, policy.stop_token_ids[0]
    generated = torch.tensor([[5, pad, 7, eos, pad, pad], [pad, pad, 9, 9, 9, 9]])
    assert response_lengths(generated, policy.stop_token_ids) == [(4, True), (6, False)]


def test_left_padding_does_not_change_outputs(tiny_model_and_tokenizer) -> None:
    model, tokenizer = tiny_model_and_tokenizer
    policy = TransformersPolicy(model, tokenizer, max_new_tokens=6, temperature=0)
    alone = policy(prompts_td(["Hi"]))[0]
    batched = policy(prompts_td(["Hi", "A much longer prompt that forces left padding of the short one"]))[0]
    assert torch.equal(alone[keys.TOKENS_RESPONSE], batched[keys.TOKENS_RESPONSE])
    torch.testing.assert_close(alone[keys.LOG_PROBS_RESPONSE], batched[keys.LOG_PROBS_RESPONSE], atol=1e-4, rtol=0)


def test_ignore_eos_generates_full_budget(tiny_model_and_tokenizer) -> None:
    model, tokenizer = tiny_model_and_tokenizer
    policy = TransformersPolicy(model, tokenizer, max_new_tokens=7, ignore_eos=True)
    out = policy(prompts_td(["a", "b"]))
    assert [t[keys.TOKENS_RESPONSE].numel() for t in flatten_turns(out)] == [7, 7]


@pytest.mark.parametrize(
    "kwargs, match",
    [({"max_new_tokens": 0}, "max_new_tokens"), ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_k": -2}, "top_k")],
)
def test_bad_sampling_settings(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingConfig(**kwargs)


def test_missing_prompt_key_is_explained(policy: TransformersPolicy) -> None:
    with pytest.raises(KeyError, match="history"):
        policy(lazy_stack([TensorDict({"x": torch.zeros(1)}, batch_size=[])]))


def test_generation_under_inference_mode(policy: TransformersPolicy) -> None:
    out = policy(prompts_td(["x"]))
    assert not out[0][keys.LOG_PROBS_RESPONSE].requires_grad


def test_stop_token_ids_end_responses_where_they_are_drawn(tiny_model_and_tokenizer) -> None:
    model, tokenizer = tiny_model_and_tokenizer
    greedy = TransformersPolicy(model, tokenizer, max_new_tokens=12, temperature=0.0)
    (full,) = greedy.generate_responses([[5, 6, 7]])
    stop = int(full.tokens[3])
    first = next(i for i, t in enumerate(full.tokens.tolist()) if t == stop)
    stopping = TransformersPolicy(model, tokenizer, max_new_tokens=12, temperature=0.0, stop_token_ids=[stop])
    (cut,) = stopping.generate_responses([[5, 6, 7]])
    assert cut.tokens.tolist() == full.tokens[: first + 1].tolist()  # kept as the last token
    assert torch.equal(cut.log_probs, full.log_probs[: first + 1])
    assert stopping.stop_token_ids == [*greedy.stop_token_ids, stop]  # the model's eos ids stay
