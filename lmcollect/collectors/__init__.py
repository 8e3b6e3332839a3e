"""Collectors: run envs against a policy and hand batches of dialog turns to a trainer."""

from lmcollect.collectors.continuous.collector import ContinuousLLMCollector
from lmcollect.collectors.lockstep.collector import LLMCollector
from lmcollect.collectors.shared.config import CollectionConfig
from lmcollect.collectors.shared.group_filter import (
    DynamicSampling,
    GroupFilter,
    SamplingCounts,
    drop_uniform_rewards,
    keep_mean_reward_in,
)
from lmcollect.collectors.shared.versioning import PolicyVersion

__all__ = [
    "CollectionConfig",
    "ContinuousLLMCollector",
    "DynamicSampling",
    "GroupFilter",
    "LLMCollector",
    "PolicyVersion",
    "SamplingCounts",
    "drop_uniform_rewards",
    "keep_mean_reward_in",
]
