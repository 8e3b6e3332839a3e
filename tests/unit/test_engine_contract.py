"""The engine contract (tests/engine_contract.py) for the in-process engines: ``TransformersEngine``,
an ``EngineRouter`` of two and the ``ScriptedEngine`` of ``lmcollect.testing``. The vLLM engines, an engine in a Ray actor and the served vLLM run
the same checks in their own modules (they start once per session there)."""
from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from lmcollect.engines import EngineRouter, TransformersEngine
from lmcollect.testing import ScriptedEngine
from tests.engine_contract import (
    CHECKS,
    EngineCase,
    Reference,
    generate_greedy,
    hf_case,
    model_eos_token_ids,
    prompts_of_lengths,
)
from tests.factories import perturbed_model

HOLD_S = 1.0  # how long a held decoding step lasts: the test thread pauses the engine meanwhile


@pytest.fixture(scope="module")
def tokenizer(tiny_model_and_tokenizer):
    return tiny_model_and_tokenizer[1]


@pytest.fixture(scope="module")
def references(tiny_model_path):
    old, new = perturbed_model(tiny_model_path, seed=1), perturbed_model(tiny_model_path, seed=2)
    return old, new


@contextlib.contextmanager
def held_step(models: list[torch.nn.Module], step: int) -> Iterator[threading.Event]:
    """Hold the ``step``-th forward pass of whichever model runs it (a request's prefill is step 1)."""
    reached, calls, hooks = threading.Event(), {}, []

    def hook(module, *_args) -> None:
        calls[id(module)] = calls.get(id(module), 0) + 1
        if calls[id(module)] == step and not reached.is_set():
            reached.set()
            time.sleep(HOLD_S)

    hooks = [model.register_forward_hook(hook) for model in models]
    try:
        yield reached
    finally:
        for handle in hooks:
            handle.remove()


def build_case(kind: str, tiny_model_path, tokenizer, references) -> EngineCase:
    """The engines' model ends responses at one more eos id: the token its greedy answer to the eos
    prompt writes third (the perturbed model never writes its own eos), so that answer stops early."""
    old, new = references
    eos_prompt = prompts_of_lengths((6,), seed=3)[0]
    own = model_eos_token_ids(old, tokenizer)
    eos_ids = [*own, generate_greedy(old, eos_prompt, 3, suppress_tokens=own)[2]]
    models = [perturbed_model(tiny_model_path, seed=1) for _ in range(1 if kind == "hf" else 2)]
    for model in models:
        model.generation_config.eos_token_id = eos_ids
    replicas = [TransformersEngine(model, tokenizer) for model in models]
    engine = replicas[0] if kind == "hf" else EngineRouter(replicas)
    return hf_case(
        engine, old, new, hold_step=lambda step: held_step(models, step), eos_token_ids=eos_ids, eos_prompt=eos_prompt
    )


def scripted_reference(tag: float) -> Reference:
    """What a ScriptedEngine holding ``tag`` answers: the digit of the tag, log-prob ``-tag``, every token."""
    return Reference(
        greedy=lambda prompt, n: [ord("0") + int(tag) % 10] * n,
        log_probs=lambda prompt, tokens: torch.full((len(tokens),), -tag),
    )


@contextlib.contextmanager
def scripted_hold(engine: ScriptedEngine, step: int) -> Iterator[threading.Event]:
    yield engine.hold_step(step, HOLD_S)


def build_scripted_case() -> EngineCase:
    engine = ScriptedEngine(num_tokens=16)  # past every check's token budget but the eos check's
    return EngineCase(
        engine=engine,
        prompts=prompts_of_lengths((3, 9, 5)),
        old=scripted_reference(0.0),
        new=scripted_reference(1.0),
        new_weights={"tag": torch.ones(1)},
        old_weights={"tag": torch.zeros(1)},
        bad_weights={"tag": torch.zeros(3)},
        hold_step=lambda step: scripted_hold(engine, step),
        eos_token_ids=(engine.eos_token_id,),
        eos_prompt=[5, 6, 7],
    )


@pytest.mark.parametrize("check", list(CHECKS))
@pytest.mark.parametrize("kind", ["hf", "router_of_two", "scripted"])
def test_engine_contract(kind: str, check: str, tiny_model_path, tokenizer, references) -> None:
    case = build_scripted_case() if kind == "scripted" else build_case(kind, tiny_model_path, tokenizer, references)
    try:
        CHECKS[check](case)
    finally:
        case.engine.close()


def test_the_scripted_engine_ends_a_response_at_a_stop_string_as_every_engine_does() -> None:
    from lmcollect.engines import EngineRequest
    from lmcollect.engines.sampling import SamplingConfig
    from lmcollect.testing.scripted_engine import ByteTokenizer

    tokenizer = ByteTokenizer()
    engine = ScriptedEngine(script=lambda prompt: tokenizer.encode("think. STOP here, then more"))
    try:
        def reply(**sampling) -> tuple[str, str]:
            request = EngineRequest(prompt_ids=[1, 2], sampling=SamplingConfig(max_new_tokens=64, **sampling))
            result = engine.submit(request).result(timeout=30)
            return tokenizer.decode(result.tokens), result.finish_reason

        assert reply(stop_strings=("STOP", "never")) == ("think. STOP", "stop")  # the completing token kept
        assert reply(stop_strings=("é",)) == ("think. STOP here, then more<|end|>", "stop")  # no match: the end token
        assert reply(stop_strings=("think",), min_new_tokens=8) == ("think. STOP here, then more<|end|>", "stop")
    finally:
        engine.close()
