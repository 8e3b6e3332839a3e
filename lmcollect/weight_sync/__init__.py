"""Weight synchronisation between a trainer and the collectors' inference engines.

Updaters push (all configured by one ``PushConfig``; ``LocalWeightUpdater`` in-process, ``vLLMUpdater`` into vLLM workers; the Ray one,
``RayRemoteWeightUpdater``, lives in :mod:`lmcollect.ray` with everything that imports Ray). They
build on :mod:`lmcollect.weights` (named tensors, checks, buckets, deltas, versions) and
:mod:`lmcollect.transports` (sender/receiver pairs that collectors pull from); the names of both
that users reach for are re-exported here. torch.distributed is imported only when first used.
"""

from __future__ import annotations

from lmcollect.lazy import lazy_attributes
from lmcollect.transports.base import WeightReceiver, WeightSender
from lmcollect.transports.shared_memory import SharedMemoryReceiver, SharedMemorySender
from lmcollect.weight_sync.base import WeightPushError, WeightUpdaterBase
from lmcollect.weight_sync.loader import LoadOptions, WeightLoader
from lmcollect.weight_sync.local import LocalWeightUpdater
from lmcollect.weight_sync.sender import PushSender
from lmcollect.weight_sync.target import WeightTarget
from lmcollect.weights.buckets import BucketLayout, TensorSlot, WeightBuckets, pack_buckets, view_buckets
from lmcollect.weights.delta import DeltaConfig, DeltaRejectedError, PushStats, WeightDelta
from lmcollect.weights.push_config import PushConfig
from lmcollect.weights.tensors import check_weights, load_weights_, to_weight_dict

_LAZY = {
    "ProcessGroupConfig": "lmcollect.transports.process_group",
    "ProcessGroupSender": "lmcollect.transports.process_group",
    "ProcessGroupReceiver": "lmcollect.transports.process_group",
    "vLLMUpdater": "lmcollect.weight_sync.vllm_updater",
    "VLLMUpdater": "lmcollect.weight_sync.vllm_updater",
}

__all__ = [
    "BucketLayout",
    "DeltaConfig",
    "DeltaRejectedError",
    "LoadOptions",
    "LocalWeightUpdater",
    "PushConfig",
    "PushSender",
    "PushStats",
    "SharedMemoryReceiver",
    "SharedMemorySender",
    "TensorSlot",
    "WeightBuckets",
    "WeightDelta",
    "WeightLoader",
    "WeightPushError",
    "WeightReceiver",
    "WeightSender",
    "WeightTarget",
    "WeightUpdaterBase",
    "check_weights",
    "load_weights_",
    "pack_buckets",
    "to_weight_dict",
    "view_buckets",
    *_LAZY,
]


__getattr__ = lazy_attributes(__name__, _LAZY)
