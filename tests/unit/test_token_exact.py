"""Token-exact multi-turn prompts: the next prompt is the previous turn's tokens plus the new messages."""
from __future__ import annotations

import logging

import pytest
import torch
from tensordict import TensorDict, lazy_stack

from lmcollect.data import History, keys
from lmcollect.data.turns import flatten_turns
from lmcollect.models import load_model_and_tokenizer
from lmcollect.policies import TransformersPolicy
from lmcollect.policies.prompt_tokens import extend_prefix
from tests.token_checks import NUM_TURNS, check_token_exact, collect_dialogs, guessing_env

IM_START, IM_END = 1, 2  # the offline tokenizer's ChatML ids
OPENING = History.from_text("Guess my number from 1 to 20.", system_prompt="Be brief.")


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def turn_tokens(tokenizer, reply_ids: list[int]) -> torch.Tensor:
    """tokens.full of a first turn whose reply was generated as ``reply_ids``."""
    return torch.tensor(encode(tokenizer, OPENING.apply_chat_template(tokenizer)) + reply_ids)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_and_tokenizer):
    return tiny_model_and_tokenizer[1]


def test_stopped_reply_gets_the_template_closing_and_matches_a_full_render(tokenizer) -> None:
    """After <|im_end|>, ChatML adds "\\n": the result equals the whole dialog rendered and tokenized."""
    content = "I guess 10"
    prefix = OPENING.append("assistant", content)
    prompt = prefix.append("user", "Higher.")
    tokens = turn_tokens(tokenizer, encode(tokenizer, content) + [IM_END])
    ids = extend_prefix(tokenizer, prompt, prefix, tokens, [IM_END])
    assert ids == encode(tokenizer, prompt.apply_chat_template(tokenizer))
    assert ids[: tokens.numel()] == tokens.tolist()


def test_truncated_reply_stays_cut(tokenizer) -> None:
    content = "I guess 1"
    prefix = OPENING.append("assistant", content)
    prompt = prefix.append("user", "Higher.")
    tokens = turn_tokens(tokenizer, encode(tokenizer, content))  # cut by max_new_tokens: no <|im_end|>
    ids = extend_prefix(tokenizer, prompt, prefix, tokens, [IM_END])
    suffix = "<|im_start|>user\nHigher.<|im_end|>\n<|im_start|>assistant\n"
    assert ids == tokens.tolist() + encode(tokenizer, suffix)
    assert IM_END not in ids[tokens.numel() - 2 : tokens.numel() + 1]


def test_generated_split_is_kept_not_retokenized(tokenizer) -> None:
    """A reply generated as single bytes keeps that split even though re-encoding would merge it."""
    content = "the number"
    merged = encode(tokenizer, content)
    split = [tokenizer.convert_tokens_to_ids(c if c != " " else "Ġ") for c in content]
    assert len(split) > len(merged) and tokenizer.decode(split) == content
    prefix = OPENING.append("assistant", content)
    prompt = prefix.append("user", "Lower.")
    tokens = turn_tokens(tokenizer, split + [IM_END])
    ids = extend_prefix(tokenizer, prompt, prefix, tokens, [IM_END])
    assert ids[: tokens.numel()] == tokens.tolist()
    assert ids != encode(tokenizer, prompt.apply_chat_template(tokenizer))  # a re-render would drift


def test_stop_token_outside_the_template_gets_the_whole_closing(tokenizer) -> None:
    content = "7"
    seven = encode(tokenizer, content)
    prefix = OPENING.append("assistant", content)
    prompt = prefix.append("user", "Lower.")
    tokens = turn_tokens(tokenizer, seven)
    ids = extend_prefix(tokenizer, prompt, prefix, tokens, [IM_END, *seven])
    assert ids == encode(tokenizer, prompt.apply_chat_template(tokenizer))  # "<|im_end|>\n" follows the "7"


def test_prompt_that_does_not_extend_the_prefix_is_not_extended(tokenizer) -> None:
    prefix = OPENING.append("assistant", "5")
    rewritten = History.from_text("A new game.").append("assistant", "5").append("user", "Higher.")
    assert extend_prefix(tokenizer, rewritten, prefix, turn_tokens(tokenizer, [IM_END]), [IM_END]) is None


def test_template_without_prefix_property_falls_back_with_one_warning(tokenizer, caplog) -> None:
    """A template that drops earlier assistant messages (as reasoning templates do) cannot be extended."""
    dropping = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    dropping.name_or_path = "dropping-template"
    dropping.chat_template = (
        "{%- for m in messages %}{%- if m['role'] != 'assistant' or loop.last %}"
        "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )
    prefix = OPENING.append("assistant", "5")
    prompt = prefix.append("user", "Higher.")
    tokens = turn_tokens(dropping, encode(dropping, "5") + [IM_END])
    with caplog.at_level(logging.WARNING, logger="lmcollect.policies.prompt_tokens"):
        assert extend_prefix(dropping, prompt, prefix, tokens, [IM_END]) is None
        assert extend_prefix(dropping, prompt, prefix, tokens, [IM_END]) is None
    assert len([r for r in caplog.records if "prefix of its continuation" in r.message]) == 1


def test_policy_uses_the_prefix_tokens(tiny_model_and_tokenizer) -> None:
    """The policy's prompt is the carried tokens plus the new messages, even when they differ from a render."""
    model, tokenizer = tiny_model_and_tokenizer
    policy = TransformersPolicy(model, tokenizer, max_new_tokens=3, temperature=0)
    content = "the number"
    split = [tokenizer.convert_tokens_to_ids(c if c != " " else "Ġ") for c in content]
    prefix = OPENING.append("assistant", content)
    tokens = turn_tokens(tokenizer, split + [IM_END])
    obs = TensorDict({"history": {"prompt": prefix.append("user", "Lower."), "prefix": prefix}, "tokens": {"prefix": tokens}})
    fresh = TensorDict({"history": {"prompt": OPENING}})
    out = policy(lazy_stack([obs, fresh]))
    assert out[0][keys.TOKENS_PROMPT][: tokens.numel()].tolist() == tokens.tolist()
    assert keys.TOKENS_PREFIX not in out[0].keys(include_nested=True)
    assert out[1][keys.TOKENS_PROMPT].tolist() == encode(tokenizer, OPENING.apply_chat_template(tokenizer))


def test_four_turn_dialogs_are_token_exact(tiny_model_path) -> None:
    """Guessing games with a real model: replies that stop (at a stop token) and replies cut by max_new_tokens."""
    model, tokenizer = load_model_and_tokenizer(tiny_model_path)  # our own copy: its stop tokens change
    # a random model almost never writes <|im_end|>; make a third of the vocabulary stop a reply
    model.generation_config.eos_token_id = [IM_END, *range(300, 640)]
    policy = TransformersPolicy(model, tokenizer, max_new_tokens=4, temperature=1.0, seed=0)
    dialogs = collect_dialogs(guessing_env(4), policy, num_turns=24)
    counts = check_token_exact(dialogs, policy.stop_token_ids, IM_START)
    assert counts.num_stopped > 0 and counts.num_truncated > 0, counts
    assert max(len(turns) for turns in dialogs) == NUM_TURNS
    for turn in (t for turns in dialogs for t in turns):  # the log-probs still match a forward pass
        assert turn[keys.LOG_PROBS_RESPONSE].numel() == turn[keys.TOKENS_RESPONSE].numel()
    from lmcollect.diagnostics import check_logprobs

    report = check_logprobs(model, lazy_stack([t for turns in dialogs for t in turns]))
    assert report.max_abs_diff <= 1e-5, report


def test_single_turn_prompts_are_rendered_and_tokenized(tiny_model_and_tokenizer) -> None:
    model, tokenizer = tiny_model_and_tokenizer
    policy = TransformersPolicy(model, tokenizer, max_new_tokens=2, temperature=0)
    out = policy(lazy_stack([TensorDict({"history": {"prompt": OPENING}})]))
    (turn,) = flatten_turns(out)
    assert turn[keys.TOKENS_PROMPT].tolist() == encode(tokenizer, turn[keys.TEXT_PROMPT])
