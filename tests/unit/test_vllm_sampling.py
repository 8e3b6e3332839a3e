"""How SamplingConfig maps onto vLLM's SamplingParams (pure: no engine needed)."""
from __future__ import annotations

import pytest

from lmcollect.engines.sampling import SamplingConfig
from lmcollect.engines.vllm.common import sampling_params_kwargs
from lmcollect.testing import ScriptedEngine


def test_generation_options_reach_vllm() -> None:
    kwargs = sampling_params_kwargs(SamplingConfig(min_new_tokens=4, repetition_penalty=1.3, temperature=0.5), seed=2)
    assert kwargs["min_tokens"] == 4 and kwargs["repetition_penalty"] == 1.3 and kwargs["seed"] == 2
    plain = sampling_params_kwargs(SamplingConfig())
    assert "min_tokens" not in plain and "repetition_penalty" not in plain


def test_ignore_eos_bans_the_eos_ids_it_is_given() -> None:
    banned = sampling_params_kwargs(SamplingConfig(ignore_eos=True), eos_token_ids=[7, 2, 7])
    assert banned["ignore_eos"] is True and banned["logit_bias"] == {2: float("-inf"), 7: float("-inf")}
    assert "logit_bias" not in sampling_params_kwargs(SamplingConfig(), eos_token_ids=[2])  # eos ends answers then
    assert "logit_bias" not in sampling_params_kwargs(SamplingConfig(ignore_eos=True))  # a plain vLLM baseline


def test_stop_strings_are_refused_with_the_alternative() -> None:
    with pytest.raises(ValueError, match="stop_strings=.*TransformersPolicy"):
        sampling_params_kwargs(SamplingConfig(stop_strings=("###",)))


def test_vllm_policy_takes_generate_style_options(tiny_model_path) -> None:
    from lmcollect.policies.vllm_policy import VLLMPolicy

    engine = ScriptedEngine()  # a real engine that is never asked to generate here
    try:
        policy = VLLMPolicy(tiny_model_path, engine=engine, do_sample=False, top_k=None)
        assert policy.sampling.greedy and policy.sampling.top_k == 0
        with pytest.raises(TypeError, match="num_beams"):
            VLLMPolicy(tiny_model_path, engine=engine, num_beams=2)
    finally:
        engine.close()


class _RecordingEngine(ScriptedEngine):
    """A scripted engine that records the stop ids each request asks it to honour."""

    def __init__(self) -> None:
        super().__init__(num_tokens=1)
        self.stop_ids: list[tuple[int, ...]] = []

    def submit(self, request):
        self.stop_ids.append(request.stop_token_ids)
        return super().submit(request)


def test_vllm_policy_sends_extra_stop_token_ids(tiny_model_path) -> None:
    from lmcollect.policies.vllm_policy import VLLMPolicy

    plain_engine, engine = _RecordingEngine(), _RecordingEngine()
    try:
        plain = VLLMPolicy(tiny_model_path, engine=plain_engine)
        plain.generate_responses([[1, 2]])
        assert plain_engine.stop_ids == [tuple(plain.stop_token_ids)]  # the model's eos ids
        policy = VLLMPolicy(tiny_model_path, engine=engine, stop_token_ids=[9, 11, plain.stop_token_ids[0]])
        policy.generate_responses([[1, 2]])
        assert policy.stop_token_ids == [*plain.stop_token_ids, 9, 11]  # prompts close replies ended on them
        assert engine.stop_ids == [tuple(policy.stop_token_ids)]
    finally:
        plain_engine.close()
        engine.close()
