"""Everything that runs on Ray, and the only package that imports it: collector, engine and buffer
actors, the Ray weight updater and object-store transport, the cluster helpers, bounded actor calls.

Each wraps a plain class of the layers below (``LLMCollector``, an engine, ``ReplayBuffer``) at the
edge. Importing this package does not import Ray; each name below imports its module on first use.
"""

from __future__ import annotations

from lmcollect.lazy import lazy_attributes

_LAZY = {
    "RayLLMCollector": "lmcollect.ray.collector",
    "CollectorActorError": "lmcollect.ray.collector",
    "RayContinuousLLMCollector": "lmcollect.ray.continuous",
    "RayCollectorGroup": "lmcollect.ray.group",
    "RayReplayBuffer": "lmcollect.ray.buffer",
    "BufferActorError": "lmcollect.ray.buffer",
    "RayEngine": "lmcollect.ray.engine",
    "ray_engine_replicas": "lmcollect.ray.engine",
    "VLLMReplicas": "lmcollect.ray.vllm_replicas",
    "RayRemoteWeightUpdater": "lmcollect.ray.updater",
    "RayWeightUpdater": "lmcollect.ray.updater",
    "RayPushConfig": "lmcollect.ray.updater",
    "PushHandle": "lmcollect.ray.updater",
    "RayObjectStoreSender": "lmcollect.ray.object_store",
    "RayObjectStoreReceiver": "lmcollect.ray.object_store",
    "init_ray": "lmcollect.ray.cluster",
    "ray_session": "lmcollect.ray.cluster",
    "CallTimeoutError": "lmcollect.ray.bounded",
    "get_within": "lmcollect.ray.bounded",
}

__all__ = sorted(_LAZY)


__getattr__ = lazy_attributes(__name__, _LAZY)
