"""Collectors: run envs against a policy and hand batches of dialog turns to a trainer."""

from lmcollect.collectors.config import CollectionConfig
from lmcollect.collectors.continuous import ContinuousLLMCollector
from lmcollect.collectors.llm_collector import LLMCollector
from lmcollect.collectors.versioning import PolicyVersion

__all__ = ["CollectionConfig", "ContinuousLLMCollector", "LLMCollector", "PolicyVersion"]
