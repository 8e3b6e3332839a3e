"""The engine contract: what every :class:`~lmcollect.engines.EngineProtocol` engine must do.

Each check takes an :class:`EngineCase` (an engine plus the oracle it is held against: plain
generation and forward passes of the weights it starts with and of the weights a push brings) and
uses only the protocol. An engine is done when every check passes for it; its test module builds
the case (``tests/unit/test_engine_contract.py`` for the in-process engines) and runs
``CHECKS`` over it. Weights reach the engine through :meth:`EngineCase.push_weights`: the engine's
own ``load_weights`` unless the case says how its trainer pushes (a vLLM server: a process-group
broadcast into its workers).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from contextlib import AbstractContextManager
from dataclasses import dataclass
from threading import Event

import pytest
import torch

from lmcollect.engines import (
    EngineClosedError,
    EngineProtocol,
    EngineRequest,
    EngineResult,
    StalePushError,
    capabilities_of,
)
from lmcollect.engines.kv_policy import configure_kv_policy, push_costs_of
from lmcollect.engines.weight_group import GroupPush
from lmcollect.weights.buckets import view_buckets
from lmcollect.weights.delta import DeltaRejectedError, WeightDelta
from lmcollect.weights.lora import LoraAdapter, LoraLayerWeights
from lmcollect.weights.version import PushVersion
from lmcollect.policies import SamplingConfig

TIMEOUT_S = 60.0
EOS_BUDGET = 24  # the token budget of the ignore_eos check: its eos prompt's answer stops well before it
PUSH_MID_STEP = 4  # the decoding step a push lands in (a request's prefill is step 1)
PAUSED_WAIT_S = 0.3  # how long a paused engine is watched for (wrongly) finishing a request


@dataclass(frozen=True)
class Reference:
    """One set of weights as plain torch computes with them."""

    greedy: Callable[[list[int], int], list[int]]
    """prompt, max_new_tokens -> the greedy tokens under ``ignore_eos`` (the model's eos ids never drawn)."""
    log_probs: Callable[[list[int], list[int]], torch.Tensor]
    """prompt, tokens -> each token's raw log-prob under one forward pass."""


@dataclass
class EngineCase:
    """An engine under test and its oracle."""

    engine: EngineProtocol
    prompts: list[list[int]]
    old: Reference
    """The weights the engine starts with."""
    new: Reference
    """The weights :attr:`new_weights` bring."""
    new_weights: dict[str, torch.Tensor]
    old_weights: dict[str, torch.Tensor]
    bad_weights: dict[str, torch.Tensor]
    """A push the engine must refuse (a wrong shape)."""
    hold_step: Callable[[int], AbstractContextManager[Event]]
    """``with case.hold_step(k) as reached:`` holds the engine inside its ``k``-th decoding step
    (``reached`` set once there) until the block ends: how a push lands mid-generation on cue."""
    eos_token_ids: tuple[int, ...]
    """The ids the engine's model ends a response at (its eos ids)."""
    eos_prompt: list[int]
    """A prompt whose greedy answer ends at one of them within ``EOS_BUDGET`` tokens (unless ``ignore_eos``)."""
    log_prob_atol: float = 1e-5
    push: Callable[[dict[str, torch.Tensor], int], None] | None = None
    """``push(weights, version)``: how the case's trainer pushes ``weights`` (refusing bad ones with a
    ValueError that says "no weight was changed"); None: ``engine.load_weights(weights.items(), version=)``."""
    caches_prefixes: bool = False
    """Whether the engine keeps a prefix cache across requests (vLLM): under ``kv_policy="keep"`` a
    dialog's next turn must then reuse its own prefix cached under the old weights."""
    responses_span_pushes: bool = True
    """Whether a push can land inside a response, whose tokens then carry their own versions. False:
    the engine's ``pause()`` returns once its responses in flight answered, so none spans a push (a
    vLLM server: each HTTP answer comes whole, its tokens all labelled with the version it was sent under)."""

    def push_weights(self, weights: dict[str, torch.Tensor], version: int) -> None:
        """Push ``weights`` as ``version`` the way this case's trainer does."""
        if self.push is None:
            self.engine.load_weights(weights.items(), version=version)
        else:
            self.push(weights, version)


def greedy(max_new_tokens: int) -> SamplingConfig:
    return SamplingConfig(temperature=0, max_new_tokens=max_new_tokens, ignore_eos=True)


def run(engine: EngineProtocol, prompt: list[int], sampling: SamplingConfig, seed: int | None = None) -> EngineResult:
    return engine.submit(EngineRequest(prompt_ids=prompt, sampling=sampling, seed=seed)).result(timeout=TIMEOUT_S)


def assert_answers_like(result: EngineResult, prompt: list[int], reference: Reference, atol: float) -> None:
    tokens = result.tokens.tolist()
    assert tokens == reference.greedy(prompt, len(tokens)), "greedy tokens differ from a plain generation"
    torch.testing.assert_close(result.log_probs, reference.log_probs(prompt, tokens), atol=atol, rtol=0)


# ---------------------------------------------------------------------- the checks
def check_greedy_equals_plain_generation_and_log_probs_a_forward_pass(case: EngineCase) -> None:
    futures = [case.engine.submit(EngineRequest(prompt_ids=p, sampling=greedy(8))) for p in case.prompts]
    for prompt, future in zip(case.prompts, futures):
        result = future.result(timeout=TIMEOUT_S)
        assert result.finish_reason == "length" and result.tokens.numel() == 8
        assert_answers_like(result, prompt, case.old, case.log_prob_atol)


def check_ignore_eos_fills_the_budget_and_only_other_stop_ids_end_it(case: EngineCase) -> None:
    """``ignore_eos``: the model's eos ids are never drawn, so an answer that would stop at one
    runs to ``max_new_tokens``, even with the eos ids among the request's stop ids (the policies
    pass them there); a stop id that is not an eos id still ends it, kept as its last token."""
    prompt, eos = case.eos_prompt, set(case.eos_token_ids)
    stopped = run(case.engine, prompt, SamplingConfig(temperature=0, max_new_tokens=EOS_BUDGET))
    assert stopped.finish_reason == "stop" and int(stopped.tokens[-1]) in eos, "the case's eos prompt must stop at an eos"
    assert stopped.tokens.numel() < EOS_BUDGET
    ignored = submit_with_stops(case.engine, prompt, greedy(EOS_BUDGET), case.eos_token_ids)
    tokens = ignored.tokens.tolist()
    assert ignored.finish_reason == "length" and len(tokens) == EOS_BUDGET and not eos & set(tokens), tokens
    assert_answers_like(ignored, prompt, case.old, case.log_prob_atol)
    other = tokens[EOS_BUDGET // 2]  # not an eos id: it ends the answer where it first appears
    ended = submit_with_stops(case.engine, prompt, greedy(EOS_BUDGET), (*case.eos_token_ids, other))
    assert ended.finish_reason == "stop" and ended.tokens.tolist() == tokens[: tokens.index(other) + 1]


def submit_with_stops(engine: EngineProtocol, prompt: list[int], sampling: SamplingConfig, stops: tuple[int, ...]) -> EngineResult:
    request = EngineRequest(prompt_ids=prompt, sampling=sampling, stop_token_ids=stops)
    return engine.submit(request).result(timeout=TIMEOUT_S)


def check_a_seeded_request_repeats(case: EngineCase) -> None:
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=12, ignore_eos=True)
    prompt = case.prompts[0]
    first, again = (run(case.engine, prompt, sampling, seed=1234) for _ in range(2))
    assert torch.equal(first.tokens, again.tokens)
    torch.testing.assert_close(first.log_probs, again.log_probs, atol=case.log_prob_atol, rtol=0)


def check_pause_and_resume_keep_requests(case: EngineCase) -> None:
    case.engine.pause()
    futures = [case.engine.submit(EngineRequest(prompt_ids=p, sampling=greedy(6))) for p in case.prompts[:2]]
    time.sleep(PAUSED_WAIT_S)
    assert not any(f.done() for f in futures), "a paused engine finished a request"
    assert case.engine.num_in_flight == 2
    case.engine.resume()
    for prompt, future in zip(case.prompts, futures):
        assert_answers_like(future.result(timeout=TIMEOUT_S), prompt, case.old, case.log_prob_atol)
    assert case.engine.num_in_flight == 0


def check_a_push_mid_generation_is_recorded_per_token(case: EngineCase) -> None:
    """A push while a request decodes: its tokens before the push carry the old version and
    weights, those after it the new ones (an engine whose responses never span a push: see
    :func:`check_a_push_waits_for_the_responses_in_flight`)."""
    prompt, num_tokens = case.prompts[1], 12
    version = case.engine.version
    with case.hold_step(PUSH_MID_STEP) as reached:
        future = case.engine.submit(EngineRequest(prompt_ids=prompt, sampling=greedy(num_tokens)))
        assert reached.wait(TIMEOUT_S), f"the engine never reached its decoding step {PUSH_MID_STEP}"
        case.engine.pause()  # returns once the held step ends
    if not case.responses_span_pushes:
        check_a_push_waits_for_the_responses_in_flight(case, future, prompt, num_tokens)
        return
    case.push_weights(case.new_weights, version + 1)
    case.engine.reset_prefix_cache()
    case.engine.resume()
    result = future.result(timeout=TIMEOUT_S)
    versions = result.token_versions.tolist()
    assert set(versions) == {version, version + 1} and versions == sorted(versions), versions
    switch = versions.index(version + 1)
    tokens = result.tokens.tolist()
    assert tokens[:switch] == case.old.greedy(prompt, switch)
    assert tokens[switch:] == case.new.greedy(prompt + tokens[:switch], num_tokens - switch)
    expected = torch.cat([case.old.log_probs(prompt, tokens)[:switch], case.new.log_probs(prompt, tokens)[switch:]])
    torch.testing.assert_close(result.log_probs, expected, atol=case.log_prob_atol, rtol=0)
    case.push_weights(case.old_weights, version + 2)  # back to the start weights
    case.engine.reset_prefix_cache()


def check_a_push_waits_for_the_responses_in_flight(
    case: EngineCase, future: Future[EngineResult], prompt: list[int], num_tokens: int
) -> None:
    """The push check of an engine whose responses never span a push (called paused; ``future``'s
    request was decoding when the pause began): ``pause()`` returned only once that response had
    answered, wholly under the old weights and version; the push labels and computes the next ones."""
    version = case.engine.version
    assert future.done(), "pause() returned before the response in flight answered: a push could land inside it"
    result = future.result(timeout=0)
    assert set(result.token_versions.tolist()) == {version} and result.tokens.numel() == num_tokens
    assert_answers_like(result, prompt, case.old, case.log_prob_atol)
    case.push_weights(case.new_weights, version + 1)
    case.engine.reset_prefix_cache()
    case.engine.resume()
    after = run(case.engine, prompt, greedy(num_tokens))
    assert set(after.token_versions.tolist()) == {version + 1}
    assert_answers_like(after, prompt, case.new, case.log_prob_atol)
    case.push_weights(case.old_weights, version + 2)  # back to the start weights
    case.engine.reset_prefix_cache()


def check_a_bad_push_changes_nothing(case: EngineCase) -> None:
    version = case.engine.version
    with pytest.raises(ValueError, match="no weight was changed"):
        case.push_weights(case.bad_weights, version + 1)
    assert case.engine.version == version
    prompt = case.prompts[2]
    assert_answers_like(run(case.engine, prompt, greedy(6)), prompt, case.old, case.log_prob_atol)


def check_an_older_push_is_refused(case: EngineCase) -> None:
    """Two pushes that arrive in the wrong order: the newer one lands first, the older is refused
    (``StalePushError``) and changes nothing, so no weights sit under another push's version."""
    version = case.engine.version
    case.push_weights(case.old_weights, version + 2)  # the newer push, first
    with pytest.raises(StalePushError, match=f"holds version {version + 2}, which is newer; no weight was changed"):
        case.push_weights(case.new_weights, version + 1)
    assert case.engine.version == version + 2
    prompt = case.prompts[2]
    result = run(case.engine, prompt, greedy(6))
    assert_answers_like(result, prompt, case.old, case.log_prob_atol)  # still the newer push's weights
    assert set(result.token_versions.tolist()) == {version + 2}


def check_close_fails_pending_futures(case: EngineCase) -> None:
    """Last: the engine is closed afterwards."""
    case.engine.pause()
    futures = [case.engine.submit(EngineRequest(prompt_ids=p, sampling=greedy(4), request_id=f"r{i}")) for i, p in enumerate(case.prompts)]
    case.engine.close()
    for future in futures:
        with pytest.raises(EngineClosedError):
            future.result(timeout=TIMEOUT_S)
    with pytest.raises(EngineClosedError, match="closed"):
        case.engine.submit(EngineRequest(prompt_ids=case.prompts[0]))


def check_kv_policies(case: EngineCase) -> None:
    """Both KV policies across a push mid-generation (an engine that cannot keep refuses ``"keep"``).

    ``"recompute"``: each token's ``kv_versions`` is its own version, and the push's cost counts the
    context it dropped (prompt + the tokens before it). ``"keep"``: the tokens after the push go on
    over the old keys/values (their ``kv_versions`` name the old version, so they differ from a
    forward pass of the new weights), nothing is recomputed, and another dialog with the very same
    tokens never reuses this dialog's old prefix (it answers exactly as the new weights do), while a
    first turn of the same version (a group's sibling) reuses that other dialog's prompt."""
    engine = case.engine
    if not capabilities_of(engine).sets_kv_policy:
        with pytest.raises(ValueError, match="kv_policy='keep'.*use kv_policy='recompute'"):
            configure_kv_policy(engine, "keep")
        return
    try:
        for policy in ("recompute", "keep"):
            engine.set_kv_policy(policy)
            _check_a_push_under(case, policy)
    finally:
        engine.set_kv_policy("recompute")


def _check_a_push_under(case: EngineCase, policy: str) -> None:
    engine, version = case.engine, case.engine.version
    prompt, num_tokens = case.prompts[1] * 16, 12  # 144 tokens: a whole prefix-cache block (128 on vLLM CPU)
    with case.hold_step(PUSH_MID_STEP) as reached:
        future = engine.submit(EngineRequest(prompt_ids=prompt, sampling=greedy(num_tokens), affinity=f"{policy}-a"))
        assert reached.wait(TIMEOUT_S), f"the engine never reached its decoding step {PUSH_MID_STEP}"
        engine.pause()
    case.push_weights(case.new_weights, version + 1)
    engine.resume()
    result = future.result(timeout=TIMEOUT_S)
    versions, tokens = result.token_versions.tolist(), result.tokens.tolist()
    switch = versions.index(version + 1)
    assert result.kv_versions is not None, f"{type(engine).__name__} reports no kv_versions"
    recomputed = sum(c.recomputed_tokens for c in push_costs_of(engine) if c.version == version + 1)
    if policy == "recompute":
        assert result.kv_versions.tolist() == versions
        assert recomputed == len(prompt) + switch, (recomputed, len(prompt), switch)
    else:
        assert result.kv_versions.tolist() == [version] * num_tokens
        assert recomputed == 0
        assert tokens[:switch] == case.old.greedy(prompt, switch)
        exact = case.new.log_probs(prompt, tokens)[switch:]
        assert not torch.allclose(result.log_probs[switch:], exact, atol=1e-3), "keep recomputed the old keys/values"
        other = engine.submit(
            EngineRequest(prompt_ids=prompt + tokens, sampling=greedy(6), affinity=f"{policy}-b")
        ).result(timeout=TIMEOUT_S)  # the same tokens, another dialog: nothing of dialog a's old prefix
        assert other.num_cached_prompt_tokens == 0 and set(other.kv_versions.tolist()) == {version + 1}
        assert_answers_like(other, prompt + tokens, case.new, case.log_prob_atol)
        sibling = engine.submit(
            EngineRequest(prompt_ids=prompt + tokens, sampling=greedy(2), affinity=f"{policy}-c")
        ).result(timeout=TIMEOUT_S)  # a first turn of the same version (a group's sibling): shares other's prompt
        assert (sibling.num_cached_prompt_tokens > 0) == case.caches_prefixes, sibling.num_cached_prompt_tokens
        assert set(sibling.kv_versions.tolist()) == {version + 1}
        later = engine.submit(EngineRequest(
            prompt_ids=prompt + tokens + prompt[:3], sampling=greedy(4), affinity=f"{policy}-a", context_kv_version=version,
        )).result(timeout=TIMEOUT_S)  # dialog a's next turn may reuse its own old prefix, and says so  # fmt: skip
        assert (later.num_cached_prompt_tokens > 0) == case.caches_prefixes, later.num_cached_prompt_tokens
        floor = version if later.num_cached_prompt_tokens > 0 else version + 1
        assert set(later.kv_versions.tolist()) == {floor}
    case.push_weights(case.old_weights, version + 2)  # back to the start weights
    engine.reset_prefix_cache()


# what each refusal must name: the fix (another updater, another engine, or another push)
REFUSAL_FIXES = {
    "full": "vLLMUpdater",
    "group_push": "RayRemoteWeightUpdater",
    "lora_adapter": "merge_and_unload",
    "weight_delta": "delta=False",
}


def probe_payloads(case: EngineCase) -> dict[str, object]:
    """One payload of each kind, each one the engine must refuse even where it loads that kind
    (full weights of a wrong shape, an adapter of a layer the model lacks, a delta of a version it
    does not hold); no process-group push: a trainer must broadcast it (checked where it is refused)."""
    version = case.engine.version
    adapter = LoraAdapter(layers={"no.such.layer.weight": LoraLayerWeights(torch.zeros(1, 4), torch.zeros(4, 1), 1.0)}, rank=1)
    delta = WeightDelta(PushVersion(version + 7), (), view_buckets({"x": torch.zeros(1)}))
    return {"full": case.bad_weights.items(), "lora_adapter": adapter, "weight_delta": delta, "group_push": GroupPush(timeout_s=1.0)}


def check_capabilities_match_what_load_weights_takes(case: EngineCase) -> None:
    """A payload kind is refused iff the engine's declared capabilities say it does not load it:
    a ``TypeError`` naming the fix, before anything is read; a kind it loads goes on to the
    payload's own checks (a ``ValueError`` or ``DeltaRejectedError`` here). Nothing changes either way."""
    engine, version = case.engine, case.engine.version
    capabilities = capabilities_of(engine)
    for kind, payload in probe_payloads(case).items():
        if capabilities.loads(kind):
            if kind == "group_push":
                continue  # received only from a trainer's broadcast: the process-group tests push it
            with pytest.raises((ValueError, DeltaRejectedError)):
                engine.load_weights(payload, version=version + 1)
        else:
            with pytest.raises(TypeError, match=REFUSAL_FIXES[kind]):
                engine.load_weights(payload, version=version + 1)
        assert engine.version == version, f"a refused {kind} changed the version"
    prompt = case.prompts[2]
    assert_answers_like(run(engine, prompt, greedy(6)), prompt, case.old, case.log_prob_atol)


CHECKS: dict[str, Callable[[EngineCase], None]] = {
    "greedy_and_log_probs": check_greedy_equals_plain_generation_and_log_probs_a_forward_pass,
    "ignore_eos": check_ignore_eos_fills_the_budget_and_only_other_stop_ids_end_it,
    "seeded_repeats": check_a_seeded_request_repeats,
    "pause_resume": check_pause_and_resume_keep_requests,
    "push_mid_generation": check_a_push_mid_generation_is_recorded_per_token,
    "bad_push": check_a_bad_push_changes_nothing,
    "older_push": check_an_older_push_is_refused,
    "capabilities": check_capabilities_match_what_load_weights_takes,
    "kv_policies": check_kv_policies,
    "close": check_close_fails_pending_futures,
}


# ---------------------------------------------------------------------- oracles
def prompts_of_lengths(lengths: tuple[int, ...], seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 1000, (n,), generator=generator).tolist() for n in lengths]


@torch.inference_mode()
def generate_greedy(model, prompt: list[int], max_new_tokens: int, **options) -> list[int]:
    """What ``model.generate`` answers greedily (stopping on the model's eos)."""
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0, **options
    )
    return out[0, len(prompt) :].tolist()


@torch.inference_mode()
def forward_log_probs(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """Raw log-probs of ``tokens`` after ``prompt`` from one plain forward pass."""
    logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0].float()
    return logits[len(prompt) - 1 : -1].log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)


def hf_case(
    engine: EngineProtocol,
    old: torch.nn.Module,
    new: torch.nn.Module,
    *,
    hold_step: Callable[[int], AbstractContextManager[Event]],
    eos_token_ids: Sequence[int],
    eos_prompt: list[int] | None = None,
    log_prob_atol: float = 1e-5,
    push: Callable[[dict[str, torch.Tensor], int], None] | None = None,
    responses_span_pushes: bool = True,
    caches_prefixes: bool = False,
) -> EngineCase:
    """The case of an engine serving a transformers model: it starts with ``old``'s weights, the
    pushes bring ``new``'s (the refused one: ``new`` with a misshapen norm weight); the engine ends
    responses at ``eos_token_ids``; ``eos_prompt`` (default: the first prompt and an eos id, which
    an untrained model with tied embeddings echoes at once); ``push`` and ``responses_span_pushes``
    as in :class:`EngineCase`."""
    bad = dict(new.state_dict())
    bad["model.norm.weight"] = torch.zeros(3)
    prompts = prompts_of_lengths((3, 9, 5))
    return EngineCase(
        engine=engine,
        prompts=prompts,
        old=hf_reference(old, eos_token_ids),
        new=hf_reference(new, eos_token_ids),
        new_weights=dict(new.state_dict()),
        old_weights=dict(old.state_dict()),
        bad_weights=bad,
        hold_step=hold_step,
        eos_token_ids=tuple(eos_token_ids),
        eos_prompt=eos_prompt if eos_prompt is not None else [*prompts[0], eos_token_ids[0]],
        log_prob_atol=log_prob_atol,
        push=push,
        responses_span_pushes=responses_span_pushes,
        caches_prefixes=caches_prefixes,
    )


def hf_reference(model, eos_token_ids: Sequence[int]) -> Reference:
    """A transformers model as the oracle: its greedy answers with ``eos_token_ids`` never drawn (``ignore_eos``)."""
    return Reference(
        greedy=lambda prompt, n: generate_greedy(model, prompt, n, suppress_tokens=list(eos_token_ids)),
        log_probs=lambda prompt, tokens: forward_log_probs(model, prompt, tokens),
    )


def model_eos_token_ids(model: torch.nn.Module, tokenizer) -> list[int]:
    """The ids a ``TransformersEngine`` over ``model`` ends responses at."""
    from lmcollect.engines.sampling import eos_token_ids

    return eos_token_ids(model.generation_config.eos_token_id, tokenizer)
