"""The CLI's vLLM backend: engine arguments and actor options of a collector holding a vLLM engine.

Collection itself works as with transformers (``start()`` in each collector's actor): a
``VLLMEngine`` runs every call on its own thread, so the actor needs no concurrency limit.
"""

from __future__ import annotations

from typing import Any

ACTOR_ENV_VARS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # the engine runs in the actor's process
CPU_KV_CACHE_BYTES = 1 << 30  # vLLM's default KV cache does not fit a CPU machine
GPU_MEMORY_SHARE = 0.85  # of the GPU share a collector gets, for its engine


def engine_kwargs(gpu_share: float) -> dict[str, Any]:
    """``vllm.LLM`` arguments for an engine given ``gpu_share`` of a GPU (0: on the CPU)."""
    if gpu_share <= 0:
        return {"kv_cache_memory_bytes": CPU_KV_CACHE_BYTES, "enforce_eager": True}
    return {"gpu_memory_utilization": GPU_MEMORY_SHARE * min(gpu_share, 1.0)}


def remote_config(gpu_share: float) -> dict[str, Any]:
    """Ray actor options of a collector with a vLLM engine (engine in the actor's process)."""
    config: dict[str, Any] = {"runtime_env": {"env_vars": dict(ACTOR_ENV_VARS)}}
    if gpu_share > 0:
        config["num_gpus"] = gpu_share
    return config


def gpu_share_per_collector(num_collectors: int) -> float:
    """The GPUs of the Ray cluster split evenly over the collectors (at most one each; 0 without GPUs)."""
    from lmcollect.ray.cluster import cluster_resource  # imports ray: the caller has started or attached to it

    num_gpus = cluster_resource("GPU")
    return min(1.0, num_gpus / num_collectors) if num_gpus else 0.0
