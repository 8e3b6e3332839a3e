"""Weight synchronisation between a trainer and the collectors' inference engines.

Updaters push (``LocalWeightUpdater`` in-process, ``RayRemoteWeightUpdater`` to collector
actors); schemes are sender/receiver pairs that collectors pull from. Ray and torch.distributed
are imported only when their classes are first used.
"""
from __future__ import annotations

from importlib import import_module
from typing import Any

from lmcollect.weight_sync.base import WeightPushError, WeightUpdaterBase
from lmcollect.weight_sync.buckets import BucketLayout, TensorSlot, WeightBuckets, pack_buckets, view_buckets
from lmcollect.weight_sync.delta import DeltaConfig, DeltaRejectedError, PushStats, WeightDelta
from lmcollect.weight_sync.local import LocalWeightUpdater
from lmcollect.weight_sync.schemes.base import WeightReceiver, WeightSender
from lmcollect.weight_sync.schemes.shared_memory import SharedMemoryReceiver, SharedMemorySender
from lmcollect.weight_sync.weights import check_weights, load_weights_, to_weight_dict

_LAZY = {
    "RayRemoteWeightUpdater": "lmcollect.weight_sync.ray_updater",
    "RayWeightUpdater": "lmcollect.weight_sync.ray_updater",
    "RayPushConfig": "lmcollect.weight_sync.ray_updater",
    "PushHandle": "lmcollect.weight_sync.ray_updater",
    "RayObjectStoreSender": "lmcollect.weight_sync.schemes.ray_object_store",
    "RayObjectStoreReceiver": "lmcollect.weight_sync.schemes.ray_object_store",
    "ProcessGroupConfig": "lmcollect.weight_sync.schemes.process_group",
    "ProcessGroupSender": "lmcollect.weight_sync.schemes.process_group",
    "ProcessGroupReceiver": "lmcollect.weight_sync.schemes.process_group",
    "vLLMUpdater": "lmcollect.weight_sync.vllm_updater",
    "VLLMUpdater": "lmcollect.weight_sync.vllm_updater",
}

__all__ = sorted(
    [
        "BucketLayout",
        "DeltaConfig",
        "DeltaRejectedError",
        "LocalWeightUpdater",
        "PushStats",
        "SharedMemoryReceiver",
        "SharedMemorySender",
        "TensorSlot",
        "WeightBuckets",
        "WeightDelta",
        "WeightPushError",
        "WeightReceiver",
        "WeightSender",
        "WeightUpdaterBase",
        "check_weights",
        "load_weights_",
        "pack_buckets",
        "to_weight_dict",
        "view_buckets",
        *_LAZY,
    ]
)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lmcollect.weight_sync' has no attribute {name!r}")
