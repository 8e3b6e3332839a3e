"""Weight synchronisation between a trainer and the collectors' inference engines.

Updaters push (``LocalWeightUpdater`` in-process, ``RayRemoteWeightUpdater`` to collector
actors, ``vLLMUpdater`` into vLLM workers). They build on :mod:`lmcollect.weights` (named tensors,
checks, buckets, deltas, versions) and :mod:`lmcollect.transports` (sender/receiver pairs that
collectors pull from); the names of both that users reach for are re-exported here. Ray and torch.distributed
are imported only when their classes are first used.
"""
from __future__ import annotations

from importlib import import_module
from typing import Any

from lmcollect.weight_sync.base import WeightPushError, WeightUpdaterBase
from lmcollect.weights.buckets import BucketLayout, TensorSlot, WeightBuckets, pack_buckets, view_buckets
from lmcollect.weights.delta import DeltaConfig, DeltaRejectedError, PushStats, WeightDelta
from lmcollect.weight_sync.local import LocalWeightUpdater
from lmcollect.transports.base import WeightReceiver, WeightSender
from lmcollect.transports.shared_memory import SharedMemoryReceiver, SharedMemorySender
from lmcollect.weights.tensors import check_weights, load_weights_, to_weight_dict

_LAZY = {
    "RayRemoteWeightUpdater": "lmcollect.weight_sync.ray_updater",
    "RayWeightUpdater": "lmcollect.weight_sync.ray_updater",
    "RayPushConfig": "lmcollect.weight_sync.ray_updater",
    "PushHandle": "lmcollect.weight_sync.ray_updater",
    "RayObjectStoreSender": "lmcollect.transports.ray_object_store",
    "RayObjectStoreReceiver": "lmcollect.transports.ray_object_store",
    "ProcessGroupConfig": "lmcollect.transports.process_group",
    "ProcessGroupSender": "lmcollect.transports.process_group",
    "ProcessGroupReceiver": "lmcollect.transports.process_group",
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
