"""lmcollect: collect LLM dialog turns for RL, in-process or as Ray actors, with live weight sync."""

from __future__ import annotations

from lmcollect.lazy import lazy_attributes
from lmcollect.startup import defer_compiler_marks

defer_compiler_marks()  # tensordict imported from now on does not import torch's compiler (~2 s per process)

__version__ = "0.1.0"


# name -> module; imported on first use so `import lmcollect` stays light (no ray, no transformers)
def _names(module: str, *names: str) -> dict[str, str]:
    return dict.fromkeys(names, module)


_EXPORTS = {
    **_names("lmcollect.data", "History", "Message", "keys"),
    **_names(
        "lmcollect.collectors",
        "LLMCollector",
        "ContinuousLLMCollector",
        "PolicyVersion",
        "DynamicSampling",
        "drop_uniform_rewards",
        "keep_mean_reward_in",
    ),
    **_names("lmcollect.buffers", "ReplayBuffer"),
    **_names("lmcollect.envs", "ChatEnv", "ChatEnvConfig", "AsyncEnvPool", "PromptDataset"),
    **_names("lmcollect.policies", "TransformersPolicy", "VLLMPolicy", "SamplingConfig"),
    **_names("lmcollect.testing", "ScriptedPolicy"),
    **_names("lmcollect.diagnostics", "check_logprobs"),
    **_names("lmcollect.checkpoint", "save_checkpoint", "load_checkpoint"),
    **_names(
        "lmcollect.weight_sync",
        "WeightUpdaterBase",
        "LocalWeightUpdater",
        "WeightPushError",
        "PushConfig",
        "WeightSender",
        "WeightReceiver",
        "SharedMemorySender",
        "SharedMemoryReceiver",
        "vLLMUpdater",
        "VLLMUpdater",
        "ProcessGroupConfig",
        "ProcessGroupSender",
        "ProcessGroupReceiver",
    ),
    **_names(
        "lmcollect.ray",
        "RayLLMCollector",
        "RayContinuousLLMCollector",
        "RayCollectorGroup",
        "RayReplayBuffer",
        "RayRemoteWeightUpdater",
        "RayWeightUpdater",
        "RayPushConfig",
        "RayObjectStoreSender",
        "RayObjectStoreReceiver",
    ),
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_attributes(__name__, _EXPORTS)
