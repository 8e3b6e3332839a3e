"""Log-probs gathered per step (no B x T x V logits), sampled log-probs, sampling keys and check_logprobs."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict, lazy_stack

import lmcollect
from lmcollect.cli.main import main
from lmcollect.cli.rollouts import batch_records, write_records
from lmcollect.collectors import LLMCollector
from lmcollect.data import History, keys
from lmcollect.data.turns import flatten_turns
from lmcollect.envs import ChatEnv, MathAnswerReward, arithmetic_dataset
from lmcollect.policies import SamplingConfig, TransformersPolicy
from lmcollect.policies.vllm_policy import VLLMPolicy

PROMPTS = ["What is 3 + 4?", "A much longer question about numbers and words, to pad the others?", "Hi"]
SETTINGS = [
    pytest.param({"temperature": 1.0}, id="t1"),
    pytest.param({"temperature": 0.7, "top_k": 50, "top_p": 0.9}, id="warped"),
    pytest.param({"temperature": 0.0}, id="greedy"),
    pytest.param({"temperature": 0.8, "ignore_eos": True}, id="ignore_eos"),
]


def prompt_ids(tokenizer) -> list[list[int]]:
    texts = [History.from_text(p).apply_chat_template(tokenizer) for p in PROMPTS]
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


def materialised_reference(policy: TransformersPolicy, ids: list[list[int]]):
    """What the policy did before: keep every step's logits and scores, then log-softmax them all."""
    s, tokenizer = policy.sampling, policy.tokenizer
    enc = tokenizer.pad({"input_ids": ids}, padding_side="left", return_tensors="pt")
    kwargs = {"max_new_tokens": s.max_new_tokens, "do_sample": not s.greedy, "pad_token_id": tokenizer.pad_token_id,
              "eos_token_id": policy.stop_token_ids, "return_dict_in_generate": True, "output_logits": True,
              "output_scores": True}
    if s.ignore_eos:
        kwargs["min_new_tokens"] = s.max_new_tokens
    sampling = {"temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k}
    kwargs.update(sampling if not s.greedy else dict.fromkeys(sampling))
    with torch.no_grad():
        out = policy.model.generate(**enc, **kwargs)
    generated = out.sequences[:, enc["input_ids"].shape[1] :]

    def gathered(steps):
        return torch.stack(steps, 1).float().log_softmax(-1).gather(-1, generated[..., None]).squeeze(-1)

    return generated, gathered(out.logits), gathered(out.scores)


@pytest.mark.parametrize("settings", SETTINGS)
def test_step_log_probs_equal_the_materialised_ones(tiny_model_and_tokenizer, settings) -> None:
    """Same tokens and same raw log-probs (<= 1e-6) as keeping all logits; sampled = the warped scores'."""
    model, tokenizer = tiny_model_and_tokenizer
    policy = TransformersPolicy(model, tokenizer, max_new_tokens=12, sampled_log_probs=True, **settings)
    ids = prompt_ids(tokenizer)
    torch.manual_seed(0)
    generations = policy.generate_responses(ids)
    torch.manual_seed(0)
    generated, raw, sampled = materialised_reference(policy, ids)
    for i, g in enumerate(generations):
        n = g.tokens.numel()
        assert torch.equal(g.tokens, generated[i, :n])
        assert (g.log_probs - raw[i, :n]).abs().max() <= 1e-6
        if policy.sampling.greedy:
            assert torch.equal(g.sampled_log_probs, torch.zeros(n))
        else:
            assert (g.sampled_log_probs - sampled[i, :n]).abs().max() <= 1e-6
    if "top_k" in settings:  # the sampled distribution is not the raw one
        assert not torch.allclose(generations[0].sampled_log_probs, generations[0].log_probs)


def test_turns_record_sampling_parameters(tiny_model_and_tokenizer) -> None:
    model, tokenizer = tiny_model_and_tokenizer
    sampling = SamplingConfig(max_new_tokens=5, temperature=0.6, top_p=0.8, top_k=40, sampled_log_probs=True)
    out = TransformersPolicy(model, tokenizer, sampling=sampling, seed=1)(
        lazy_stack([TensorDict({"history": {"prompt": History.from_text(p)}}) for p in PROMPTS])
    )
    for turn in flatten_turns(out):
        assert turn[keys.SAMPLING_TEMPERATURE].dtype == torch.float32 and turn[keys.SAMPLING_TEMPERATURE].item() == pytest.approx(0.6)
        assert turn[keys.SAMPLING_TOP_P].item() == pytest.approx(0.8)
        assert turn[keys.SAMPLING_TOP_K].dtype == torch.int64 and turn[keys.SAMPLING_TOP_K].item() == 40
        assert turn[keys.SAMPLING_MAX_NEW_TOKENS].item() == 5 and turn[keys.SAMPLING_SAMPLED_LOG_PROBS].item()
        assert turn[keys.LOG_PROBS_SAMPLED].shape == turn[keys.LOG_PROBS_RESPONSE].shape
        assert (turn[keys.LOG_PROBS_SAMPLED] >= turn[keys.LOG_PROBS_RESPONSE] - 1e-6).all()  # near-uniform model: top-k 40 raises each kept token


def test_sampled_log_probs_are_off_by_default(tiny_model_and_tokenizer) -> None:
    model, tokenizer = tiny_model_and_tokenizer
    out = TransformersPolicy(model, tokenizer, max_new_tokens=3)(lazy_stack([TensorDict({"history": {"prompt": History.from_text("x")}})]))
    assert keys.LOG_PROBS_SAMPLED not in out[0].keys(include_nested=True)
    assert not out[0][keys.SAMPLING_SAMPLED_LOG_PROBS].item()


def test_vllm_policy_refuses_sampled_log_probs() -> None:
    with pytest.raises(ValueError, match="logprobs_mode per engine"):
        VLLMPolicy("/nowhere", sampled_log_probs=True)


# ------------------------------------------------------------------------------------ check_logprobs
@pytest.fixture(scope="module")
def collected(tiny_model_and_tokenizer):
    model, tokenizer = tiny_model_and_tokenizer
    env = ChatEnv(arithmetic_dataset(32, seed=0), reward_fn=MathAnswerReward(), batch_size=4, seed=0)
    policy = TransformersPolicy(model, tokenizer, max_new_tokens=10, temperature=1.0, seed=0)
    collector = LLMCollector(env, policy=policy, dialog_turns_per_batch=8, track_policy_version=True)
    batch = collector.next()
    collector.shutdown()
    return batch


def test_check_logprobs_of_the_hf_policy_is_within_1e_5(tiny_model_and_tokenizer, collected) -> None:
    report = lmcollect.check_logprobs(tiny_model_and_tokenizer[0], collected)
    assert report.num_sequences == 8
    assert report.num_tokens == sum(t[keys.TOKENS_RESPONSE].numel() for t in flatten_turns(collected))
    assert report.max_abs_diff <= 1e-5
    assert report.mean_exp_abs_diff == pytest.approx(1.0, abs=1e-5)
    assert report.min_sequence_ratio == pytest.approx(1.0, abs=1e-4) == report.max_sequence_ratio


def test_check_logprobs_sees_a_mismatch(tiny_model_and_tokenizer, collected) -> None:
    turns = flatten_turns(collected)
    shifted = [t.clone() for t in turns]
    shifted[0].set(keys.LOG_PROBS_RESPONSE, shifted[0][keys.LOG_PROBS_RESPONSE] + 0.5)  # stored too likely
    report = lmcollect.check_logprobs(tiny_model_and_tokenizer[0], lazy_stack(shifted))
    num_tokens = turns[0][keys.TOKENS_RESPONSE].numel()
    assert report.max_abs_diff == pytest.approx(0.5, abs=1e-4)
    assert report.min_sequence_ratio == pytest.approx(torch.tensor(-0.5 * num_tokens).exp().item(), rel=1e-3)
    assert report.max_sequence_ratio == pytest.approx(1.0, abs=1e-4)


def test_check_logprobs_chunks_give_the_same_report(tiny_model_and_tokenizer, collected) -> None:
    whole = lmcollect.check_logprobs(tiny_model_and_tokenizer[0], collected)
    chunked = lmcollect.check_logprobs(tiny_model_and_tokenizer[0], collected, tokens_per_forward=40)
    assert chunked.num_tokens == whole.num_tokens and chunked.max_abs_diff <= 1e-5


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_cli_check_logprobs(tmp_path: Path, tiny_model_path, collected, suffix, capsys) -> None:
    records = batch_records(collected)
    rollouts = write_records(records, tmp_path / f"rollouts{suffix}")
    report_file = tmp_path / "report.json"
    argv = ["check-logprobs", "--rollouts", str(rollouts), "--model", str(tiny_model_path), "--output", str(report_file)]
    assert main([*argv, "--max-abs-diff", "1e-5"]) == 0
    assert "per-sequence ratio" in capsys.readouterr().out
    report = json.loads(report_file.read_text())
    assert report["num_sequences"] == len(records) and report["max_abs_diff"] <= 1e-5
    assert report["num_stale_context_tokens"] == 0  # lockstep: every token's context is its own weights'
    records[0]["log_probs"] = [lp - 0.1 for lp in records[0]["log_probs"]]
    records[1]["token_versions"] = [1] * len(records[1]["token_versions"])  # as kv_policy="keep" records a
    records[1]["kv_versions"] = [0] * len(records[1]["kv_versions"])  # turn over a context of version 0
    write_records(records, rollouts)
    assert main([*argv, "--max-abs-diff", "1e-5"]) == 1
    assert f"keys/values of older weights (kv_policy='keep'): {len(records[1]['log_probs'])};" in capsys.readouterr().out
    assert json.loads(report_file.read_text())["num_stale_context_tokens"] == len(records[1]["log_probs"])


def test_cli_check_logprobs_input_errors(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["check-logprobs"])
    assert exc.value.code == 2
    (tmp_path / "bad.jsonl").write_text(json.dumps({"prompt": "x"}) + "\n")
    with pytest.raises(SystemExit) as exc:
        main(["check-logprobs", "--rollouts", str(tmp_path / "bad.jsonl")])
    assert exc.value.code == 2
