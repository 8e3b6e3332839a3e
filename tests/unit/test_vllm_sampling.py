"""How SamplingConfig maps onto vLLM's SamplingParams (pure: no engine needed)."""
from __future__ import annotations

import pytest

from lmcollect.engines.sampling import SamplingConfig
from lmcollect.engines.vllm_common import sampling_params_kwargs


def test_generation_options_reach_vllm() -> None:
    kwargs = sampling_params_kwargs(SamplingConfig(min_new_tokens=4, repetition_penalty=1.3, temperature=0.5), seed=2)
    assert kwargs["min_tokens"] == 4 and kwargs["repetition_penalty"] == 1.3 and kwargs["seed"] == 2
    plain = sampling_params_kwargs(SamplingConfig())
    assert "min_tokens" not in plain and "repetition_penalty" not in plain


def test_stop_strings_are_refused_with_the_alternative() -> None:
    with pytest.raises(ValueError, match="stop_strings=.*TransformersPolicy"):
        sampling_params_kwargs(SamplingConfig(stop_strings=("###",)))


def test_vllm_policy_takes_generate_style_options(tiny_model_path) -> None:
    from lmcollect.policies.vllm_policy import VLLMPolicy

    class _NoEngine:
        """Stands in for an engine that is never called (only the options are checked)."""

    policy = VLLMPolicy(tiny_model_path, engine=_NoEngine(), do_sample=False, top_k=None)
    assert policy.sampling.greedy and policy.sampling.top_k == 0
    with pytest.raises(TypeError, match="num_beams"):
        VLLMPolicy(tiny_model_path, engine=_NoEngine(), num_beams=2)


def test_vllm_policy_sends_extra_stop_token_ids(tiny_model_path) -> None:
    from lmcollect.engines.vllm_common import Completion
    from lmcollect.policies.vllm_policy import VLLMPolicy

    class _RecordingEngine:
        """Answers every prompt with one token and records the stop ids it was asked to honour."""

        def __init__(self) -> None:
            self.calls: list[dict] = []

        def generate_tokens(self, prompts, sampling, seeds=None, **options):
            self.calls.append(options)
            return [Completion([7], [-0.5]) for _ in prompts]

    plain_engine, engine = _RecordingEngine(), _RecordingEngine()
    plain = VLLMPolicy(tiny_model_path, engine=plain_engine)
    plain.generate_responses([[1, 2]])
    assert plain_engine.calls == [{}]  # nothing new for engines without the option
    policy = VLLMPolicy(tiny_model_path, engine=engine, stop_token_ids=[9, 11, plain.stop_token_ids[0]])
    policy.generate_responses([[1, 2]])
    assert engine.calls == [{"stop_token_ids": [9, 11]}]  # the eos is the engine's own
    assert policy.stop_token_ids == [*plain.stop_token_ids, 9, 11]  # prompts close replies ended on them
