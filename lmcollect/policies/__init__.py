"""Lockstep policies: callables that answer a batch of chat prompts (``EnginePolicy`` over any engine)."""

from __future__ import annotations

from lmcollect.engines.sampling import RequestSeeds, SamplingConfig
from lmcollect.lazy import lazy_attributes
from lmcollect.policies.engine_policy import EnginePolicy
from lmcollect.policies.protocol import PolicyProtocol

# transformers (and the HTTP client of the served engine) are slow to import: a process that never
# builds these policies (a collector actor over a scripted policy, the CLI's --help) never pays for them
_LAZY = {
    "TransformersPolicy": "lmcollect.policies.transformers_policy",
    "VLLMPolicy": "lmcollect.policies.vllm_policy",
    "VLLMServer": "lmcollect.engines.served",
    "VLLMServerError": "lmcollect.engines.served",
    "VLLMServerPolicy": "lmcollect.policies.vllm_server",
}

__all__ = ["EnginePolicy", "PolicyProtocol", "RequestSeeds", "SamplingConfig", *_LAZY]


__getattr__ = lazy_attributes(__name__, _LAZY)
