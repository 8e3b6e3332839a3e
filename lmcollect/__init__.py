"""lmcollect: collect LLM dialog turns for RL, in-process or as Ray actors, with live weight sync."""
from __future__ import annotations

from importlib import import_module
from typing import Any

__version__ = "0.1.0"

# name -> module; imported on first use so `import lmcollect` stays light (no ray, no transformers)
_EXPORTS = {
    "History": "lmcollect.data",
    "Message": "lmcollect.data",
    "keys": "lmcollect.data",
    "LLMCollector": "lmcollect.collectors",
    "ContinuousLLMCollector": "lmcollect.collectors",
    "PolicyVersion": "lmcollect.collectors",
    "RayLLMCollector": "lmcollect.collectors.ray_collector",
    "RayContinuousLLMCollector": "lmcollect.collectors.ray_continuous",
    "RayCollectorGroup": "lmcollect.collectors.ray_group",
    "ReplayBuffer": "lmcollect.buffers",
    "RayReplayBuffer": "lmcollect.buffers.ray_buffer",
    "ChatEnv": "lmcollect.envs",
    "ChatEnvConfig": "lmcollect.envs",
    "AsyncEnvPool": "lmcollect.envs",
    "PromptDataset": "lmcollect.envs",
    "TransformersPolicy": "lmcollect.policies",
    "ScriptedPolicy": "lmcollect.policies",
    "SamplingConfig": "lmcollect.policies",
    "check_logprobs": "lmcollect.diagnostics",
    "save_checkpoint": "lmcollect.checkpoint",
    "load_checkpoint": "lmcollect.checkpoint",
    "WeightUpdaterBase": "lmcollect.weight_sync",
    "LocalWeightUpdater": "lmcollect.weight_sync",
    "WeightPushError": "lmcollect.weight_sync",
    "WeightSender": "lmcollect.weight_sync",
    "WeightReceiver": "lmcollect.weight_sync",
    "SharedMemorySender": "lmcollect.weight_sync",
    "SharedMemoryReceiver": "lmcollect.weight_sync",
    "RayRemoteWeightUpdater": "lmcollect.weight_sync.ray_updater",
    "RayWeightUpdater": "lmcollect.weight_sync.ray_updater",
    "RayPushConfig": "lmcollect.weight_sync.ray_updater",
    "vLLMUpdater": "lmcollect.weight_sync.vllm_updater",
    "VLLMUpdater": "lmcollect.weight_sync.vllm_updater",
    "RayObjectStoreSender": "lmcollect.transports.ray_object_store",
    "RayObjectStoreReceiver": "lmcollect.transports.ray_object_store",
    "ProcessGroupConfig": "lmcollect.transports.process_group",
    "ProcessGroupSender": "lmcollect.transports.process_group",
    "ProcessGroupReceiver": "lmcollect.transports.process_group",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'lmcollect' has no attribute {name!r}")
