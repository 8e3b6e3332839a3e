"""TransformersPolicy's generation options (min_new_tokens, ignore_eos, do_sample, repetition_penalty,
stop_strings, None as "off"): what they do to the tokens, and raw log-probs that stay exact."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from tensordict import TensorDict, lazy_stack
from transformers import RepetitionPenaltyLogitsProcessor

from lmcollect.data import History, keys
from lmcollect.data.turns import flatten_turns
from lmcollect.policies import SamplingConfig, TransformersPolicy
from tests.token_checks import check_token_exact, collect_dialogs, guessing_env

PROMPTS = ["What is 3 + 4?", "Guess a number from 1 to 20, please, quickly.", "Hi"]


def prompts_td(texts: list[str]) -> TensorDict:
    return lazy_stack([TensorDict({"history": {"prompt": History.from_text(t)}}, batch_size=[]) for t in texts])


def forward_logits(model, turn) -> torch.Tensor:
    """Logits at the positions that predicted the response tokens, ``[n_response, V]``."""
    ids = turn[keys.TOKENS_FULL].unsqueeze(0)
    with torch.no_grad():
        logits = model(ids).logits.float()[0, :-1]
    return logits[-turn[keys.TOKENS_RESPONSE].numel() :]


def forward_log_probs(model, turn) -> torch.Tensor:
    chosen = turn[keys.TOKENS_RESPONSE][:, None]
    return forward_logits(model, turn).log_softmax(-1).gather(-1, chosen).squeeze(-1)


def assert_raw_log_probs_exact(model, out) -> None:
    for turn in flatten_turns(out):
        torch.testing.assert_close(turn[keys.LOG_PROBS_RESPONSE], forward_log_probs(model, turn), atol=1e-4, rtol=0)


@contextmanager
def eos_favoured(model, eos_id: int, boost: float = 30.0) -> Iterator[None]:
    """The model with a large bonus on the eos logit (a model that wants to stop at once)."""

    def boost_eos(_module, _args, output):
        output.logits[..., eos_id] += boost

    handle = model.register_forward_hook(boost_eos)  # before the policy's own hook: it sees the boost
    try:
        yield
    finally:
        handle.remove()


# ---------------------------------------------------------------------------------------- accepted as generate() takes them
def test_the_options_from_the_issue_are_accepted(tiny_model_and_tokenizer) -> None:
    model, tokenizer = tiny_model_and_tokenizer
    for kwargs in ({"min_new_tokens": 8}, {"do_sample": True}, {"top_k": None}, {"top_p": None, "temperature": None}):
        policy = TransformersPolicy(model, tokenizer, max_new_tokens=8, seed=0, **kwargs)
        out = policy(prompts_td(PROMPTS[:2]))
        assert out.batch_size == torch.Size([2])
    assert TransformersPolicy(model, tokenizer, top_k=None, top_p=None, temperature=None).sampling == SamplingConfig()


def test_do_sample_false_is_greedy(tiny_model_and_tokenizer) -> None:
    model, tokenizer = tiny_model_and_tokenizer
    greedy = TransformersPolicy(model, tokenizer, max_new_tokens=8, do_sample=False)
    assert greedy.sampling.temperature == 0
    reference = TransformersPolicy(model, tokenizer, max_new_tokens=8, temperature=0)
    for a, b in zip(flatten_turns(greedy(prompts_td(PROMPTS))), flatten_turns(reference(prompts_td(PROMPTS)))):
        assert torch.equal(a[keys.TOKENS_RESPONSE], b[keys.TOKENS_RESPONSE])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"do_sample": True, "temperature": 0}, r"do_sample=True needs temperature > 0"),
        ({"do_sample": False, "temperature": 0.7}, r"do_sample=False means greedy decoding, but temperature=0.7"),
        ({"num_beams": 4}, r"unsupported generation option\(s\) \['num_beams'\]\. num_beams: beam search is not supported"),
        ({"num_return_sequences": 4}, r"ChatEnv\(repeats=k\)"),
        ({"max_length": 64}, r"use max_new_tokens"),
        ({"stop": ["\n"]}, r"unsupported generation option\(s\) \['stop'\]\. Supported: max_new_tokens, .*stop_strings.*do_sample"),
    ],
)
def test_unsupported_or_contradictory_options_are_explained(tiny_model_and_tokenizer, kwargs, match) -> None:
    model, tokenizer = tiny_model_and_tokenizer
    error = TypeError if "unsupported" in match or "repeats" in match or "max_new_tokens" in match else ValueError
    with pytest.raises(error, match=match):
        TransformersPolicy(model, tokenizer, **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"top_k": None}, r"top_k must be an int >= 0 \(0 = off\), got None"),
        ({"top_k": 2.5}, r"top_k must be an int >= 0"),
        ({"temperature": "hot"}, r"temperature must be 0 \(greedy\) or >= 0.01 .*, got 'hot'"),
        ({"min_new_tokens": 40}, r"min_new_tokens \(40\) exceeds max_new_tokens \(32\)"),
        ({"repetition_penalty": 0}, r"repetition_penalty must be > 0 \(1 = off\)"),
        ({"stop_strings": ["", "x"]}, r"stop_strings must be non-empty strings"),
    ],
)
def test_sampling_config_names_the_field_and_the_range(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingConfig(**kwargs)


def test_one_stop_string_is_not_split_into_characters() -> None:
    assert SamplingConfig(stop_strings="\n\n").stop_strings == ("\n\n",)
    assert SamplingConfig(stop_strings=["a", "b"]).stop_strings == ("a", "b")


# ---------------------------------------------------------------------------------------- eos: min_new_tokens, ignore_eos
def test_min_new_tokens_holds_eos_off_and_sampled_log_probs_see_it(tiny_model_and_tokenizer) -> None:
    model, tokenizer = tiny_model_and_tokenizer
    eos = TransformersPolicy(model, tokenizer).stop_token_ids[0]
    with eos_favoured(model, eos):
        plain = TransformersPolicy(model, tokenizer, max_new_tokens=12, seed=0)
        assert [t[keys.TOKENS_RESPONSE].tolist() for t in flatten_turns(plain(prompts_td(PROMPTS)))] == [[eos]] * 3
        policy = TransformersPolicy(model, tokenizer, max_new_tokens=12, min_new_tokens=5, seed=0, sampled_log_probs=True)
        out = policy(prompts_td(PROMPTS))
        for turn in flatten_turns(out):
            tokens = turn[keys.TOKENS_RESPONSE]
            assert tokens.numel() == 6 and int(tokens[-1]) == eos and eos not in tokens[:5].tolist()
            # the sampled distribution had eos masked for the first five tokens, and only then
            logits = forward_logits(model, turn)
            logits[:5, eos] = -float("inf")
            expected = logits.log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1)
            torch.testing.assert_close(turn[keys.LOG_PROBS_SAMPLED], expected, atol=1e-4, rtol=0)
        assert_raw_log_probs_exact(model, out)


def test_ignore_eos_fills_the_budget_of_a_model_that_wants_to_stop(tiny_model_and_tokenizer) -> None:
    model, tokenizer = tiny_model_and_tokenizer
    eos = TransformersPolicy(model, tokenizer).stop_token_ids[0]
    with eos_favoured(model, eos):
        out = TransformersPolicy(model, tokenizer, max_new_tokens=7, ignore_eos=True, seed=0)(prompts_td(PROMPTS))
        assert [t[keys.TOKENS_RESPONSE].numel() for t in flatten_turns(out)] == [7, 7, 7]
        assert all(eos not in t[keys.TOKENS_RESPONSE].tolist() for t in flatten_turns(out))
        assert_raw_log_probs_exact(model, out)


# ---------------------------------------------------------------------------------------- repetition_penalty
def test_repetition_penalty_shapes_the_sampled_distribution_not_the_raw_log_probs(tiny_model_and_tokenizer) -> None:
    model, tokenizer = tiny_model_and_tokenizer
    penalty = 1.5
    policy = TransformersPolicy(model, tokenizer, max_new_tokens=10, repetition_penalty=penalty, seed=0, sampled_log_probs=True)
    out = policy(prompts_td(PROMPTS))
    processor = RepetitionPenaltyLogitsProcessor(penalty)
    for turn in flatten_turns(out):
        full, n = turn[keys.TOKENS_FULL], turn[keys.TOKENS_RESPONSE].numel()
        logits = forward_logits(model, turn)
        num_prompt = full.numel() - n
        penalised = torch.stack([processor(full[None, : num_prompt + t], logits[t : t + 1])[0] for t in range(n)])
        expected = penalised.log_softmax(-1).gather(-1, turn[keys.TOKENS_RESPONSE][:, None]).squeeze(-1)
        torch.testing.assert_close(turn[keys.LOG_PROBS_SAMPLED], expected, atol=1e-4, rtol=0)
    assert_raw_log_probs_exact(model, out)


def test_a_strong_repetition_penalty_stops_greedy_repeats(tiny_model_and_tokenizer) -> None:
    model, tokenizer = tiny_model_and_tokenizer
    out = TransformersPolicy(model, tokenizer, max_new_tokens=12, temperature=0, repetition_penalty=1e4)(prompts_td(PROMPTS))
    for turn in flatten_turns(out):
        response, prompt = turn[keys.TOKENS_RESPONSE].tolist(), set(turn[keys.TOKENS_PROMPT].tolist())
        assert len(set(response)) == len(response) and not prompt & set(response)


# ---------------------------------------------------------------------------------------- stop_strings
def _expected_cut(tokenizer, tokens: list[int], stop_strings: list[str], min_new_tokens: int = 0) -> int:
    """The shortest prefix whose text contains a stop string (at or past min_new_tokens), else all."""
    for n in range(max(1, min_new_tokens), len(tokens) + 1):
        if any(s in tokenizer.decode(tokens[:n], skip_special_tokens=True) for s in stop_strings):
            return n
    return len(tokens)


def test_stop_strings_end_a_response_at_the_token_completing_them(tiny_model_and_tokenizer) -> None:
    model, tokenizer = tiny_model_and_tokenizer
    free = TransformersPolicy(model, tokenizer, max_new_tokens=16, temperature=0, ignore_eos=True)(prompts_td(PROMPTS))
    free_turns = list(flatten_turns(free))
    first = free_turns[0][keys.TOKENS_RESPONSE].tolist()
    stop = tokenizer.decode(first[3:5], skip_special_tokens=True)  # text from the middle of the first response
    assert stop, "pick tokens that decode to text"
    stop_strings = [stop, "What is"]  # "What is" is in a prompt: prompt text never counts
    policy = TransformersPolicy(model, tokenizer, max_new_tokens=16, temperature=0, ignore_eos=True, stop_strings=stop_strings)
    out = policy(prompts_td(PROMPTS))
    cuts = []
    for turn, reference in zip(flatten_turns(out), free_turns):
        tokens = reference[keys.TOKENS_RESPONSE].tolist()
        n = _expected_cut(tokenizer, tokens, stop_strings)
        cuts.append(n)
        assert turn[keys.TOKENS_RESPONSE].tolist() == tokens[:n]
        torch.testing.assert_close(turn[keys.LOG_PROBS_RESPONSE], reference[keys.LOG_PROBS_RESPONSE][:n])
    assert cuts[0] <= 5 and stop in flatten_turns(out)[0][keys.TEXT_RESPONSE]
    assert_raw_log_probs_exact(model, out)
    # min_new_tokens holds stop strings off too
    held = TransformersPolicy(
        model, tokenizer, max_new_tokens=16, temperature=0, ignore_eos=True, stop_strings=stop_strings, min_new_tokens=16
    )(prompts_td(PROMPTS))
    assert [t[keys.TOKENS_RESPONSE].numel() for t in flatten_turns(held)] == [16, 16, 16]


def test_stop_strings_keep_multi_turn_prompts_token_exact(tiny_model_and_tokenizer) -> None:
    """A reply ended by a stop string continues like a cut reply: the next prompt starts with its tokens."""
    model, tokenizer = tiny_model_and_tokenizer
    policy = TransformersPolicy(model, tokenizer, max_new_tokens=12, seed=0, ignore_eos=True, stop_strings=["e", "1"])
    dialogs = collect_dialogs(guessing_env(4), policy, num_turns=16)
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    counts = check_token_exact(dialogs, policy.stop_token_ids, im_start)
    assert counts.num_continued > 0
    ended_by_stop = [t for turns in dialogs for t in turns if t[keys.TOKENS_RESPONSE].numel() < 12]
    assert ended_by_stop and all(("e" in t[keys.TEXT_RESPONSE] or "1" in t[keys.TEXT_RESPONSE]) for t in ended_by_stop)
