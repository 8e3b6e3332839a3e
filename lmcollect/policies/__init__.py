"""Inference backends: callables that answer a batch of chat prompts."""
from lmcollect.policies.protocol import PolicyProtocol
from lmcollect.policies.sampling import SamplingConfig
from lmcollect.policies.scripted import ScriptedPolicy
from lmcollect.policies.transformers_policy import TransformersPolicy
from lmcollect.policies.vllm_server import VLLMServer, VLLMServerError, VLLMServerPolicy

__all__ = [
    "PolicyProtocol",
    "SamplingConfig",
    "ScriptedPolicy",
    "TransformersPolicy",
    "VLLMServer",
    "VLLMServerError",
    "VLLMServerPolicy",
]
