"""VLLMPolicy: token-exact multi-turn dialogs and stored log-probs against a forward pass; skipped without vLLM.

Uses the session's in-process engine (``greedy_policy`` in conftest) on ``model_dir``, whose extra
eos id ends the greedy answer to ``QUESTIONS[0]``: dialogs then hold replies that stop at a stop
token and replies cut by ``max_new_tokens``.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from tensordict import lazy_stack

from lmcollect.data import keys
from lmcollect.diagnostics import check_logprobs
from lmcollect.models import load_model_and_tokenizer
from lmcollect.policies import TransformersPolicy
from lmcollect.policies.vllm_policy import VLLMPolicy
from tests.integration.conftest import MAX_NEW_TOKENS, QUESTIONS
from tests.token_checks import NUM_TURNS, check_token_exact, collect_dialogs, guessing_env

pytestmark = pytest.mark.integration

IM_START = 1
NUM_DIALOG_TURNS = 16


def make_env():
    return guessing_env(4, system_prompt="Be brief.", rows=[{"prompt": q} for q in QUESTIONS])


@pytest.fixture(scope="module")
def vllm_dialogs(greedy_policy: VLLMPolicy) -> list[list[Any]]:
    return collect_dialogs(make_env(), greedy_policy, NUM_DIALOG_TURNS)


@pytest.fixture(scope="module")
def reference_model(model_dir: Path) -> Any:
    return load_model_and_tokenizer(model_dir)


def test_four_turn_dialogs_are_token_exact(greedy_policy: VLLMPolicy, vllm_dialogs) -> None:
    counts = check_token_exact(vllm_dialogs, greedy_policy.stop_token_ids, IM_START)
    assert counts.num_stopped > 0 and counts.num_truncated > 0, counts
    assert max(len(turns) for turns in vllm_dialogs) == NUM_TURNS


def test_dialogs_match_transformers_token_for_token(vllm_dialogs, reference_model) -> None:
    model, tokenizer = reference_model
    reference = TransformersPolicy(model, tokenizer, temperature=0.0, max_new_tokens=MAX_NEW_TOKENS)
    want = collect_dialogs(make_env(), reference, NUM_DIALOG_TURNS)
    got_turns = [t for turns in vllm_dialogs for t in turns]
    want_turns = [t for turns in want for t in turns]
    assert len(got_turns) == len(want_turns)
    for got, expected in zip(got_turns, want_turns):
        assert torch.equal(got[keys.TOKENS_FULL], expected[keys.TOKENS_FULL])


def test_stored_log_probs_match_a_forward_pass(vllm_dialogs, reference_model) -> None:
    report = check_logprobs(reference_model[0], lazy_stack([t for turns in vllm_dialogs for t in turns]))
    assert report.num_sequences == NUM_DIALOG_TURNS
    assert report.max_abs_diff <= 1e-4, report.summary()


def test_sampled_dialogs_are_token_exact(engine: Any, model_dir: Path, reference_model) -> None:
    policy = VLLMPolicy(model_dir, engine=engine, temperature=1.0, top_k=50, max_new_tokens=6, seed=0)
    dialogs = collect_dialogs(make_env(), policy, NUM_DIALOG_TURNS)
    counts = check_token_exact(dialogs, policy.stop_token_ids, IM_START)
    assert counts.num_continued > 0
    turns = [t for d in dialogs for t in d]
    assert all(t[keys.SAMPLING_TOP_K].item() == 50 and t[keys.SAMPLING_TEMPERATURE].item() == 1.0 for t in turns)
    assert check_logprobs(reference_model[0], lazy_stack(turns)).max_abs_diff <= 1e-4
