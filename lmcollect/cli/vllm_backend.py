"""The CLI's vLLM backend: engine and actor settings, and collection driven from the driver's threads.

vLLM's CPU kernels must run on the thread that built the engine, so a collector actor holding a
vLLM engine takes one call at a time (``max_concurrency=1``) and never collects from a background
thread of its own (``start()``): :class:`DriverSideCollection` keeps each collector busy with
``next()`` calls from a driver thread instead, and weight pushes queue between two batches.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

logger = logging.getLogger(__name__)

ACTOR_ENV_VARS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # the engine runs in the actor's process
CPU_KV_CACHE_BYTES = 1 << 30  # vLLM's default KV cache does not fit a CPU machine
GPU_MEMORY_SHARE = 0.85  # of the GPU share a collector gets, for its engine


def engine_kwargs(gpu_share: float) -> dict[str, Any]:
    """``vllm.LLM`` arguments for an engine given ``gpu_share`` of a GPU (0: on the CPU)."""
    if gpu_share <= 0:
        return {"kv_cache_memory_bytes": CPU_KV_CACHE_BYTES, "enforce_eager": True}
    return {"gpu_memory_utilization": GPU_MEMORY_SHARE * min(gpu_share, 1.0)}


def remote_config(gpu_share: float) -> dict[str, Any]:
    """Ray actor options of a collector with a vLLM engine (one call at a time, engine in-process)."""
    config: dict[str, Any] = {"max_concurrency": 1, "runtime_env": {"env_vars": dict(ACTOR_ENV_VARS)}}
    if gpu_share > 0:
        config["num_gpus"] = gpu_share
    return config


def gpu_share_per_collector(num_collectors: int) -> float:
    """The GPUs of the Ray cluster split evenly over the collectors (at most one each; 0 without GPUs)."""
    import ray  # imported here: the caller has started or attached to Ray

    num_gpus = ray.cluster_resources().get("GPU", 0.0)
    return min(1.0, num_gpus / num_collectors) if num_gpus else 0.0


class DriverSideCollection:
    """Keeps collectors writing into their replay buffer from driver threads (``next()`` in a loop).

    The same contract as ``start()`` / ``is_running()`` / ``shutdown()`` for the collection itself:
    :meth:`start` starts one thread per collector, :meth:`is_running` re-raises the error that
    stopped a thread, :meth:`stop` lets each finish its batch and joins it.
    """

    def __init__(self, collectors: Sequence[Any]) -> None:
        self._collectors = list(collectors)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._errors: list[BaseException] = []

    def start(self) -> None:
        for i, collector in enumerate(self._collectors):
            name = f"lmcollect-driver-collect-{i}"
            thread = threading.Thread(target=self._collect, args=(collector,), name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def _collect(self, collector: Any) -> None:
        try:
            while not self._stop.is_set():
                collector.next()  # one batch, written into the collector's replay buffer
        except BaseException as exc:  # designed: surfaced by is_running() in the trainer's thread
            if not self._stop.is_set():
                logger.exception("driver-side collection failed")
                self._errors.append(exc)

    def is_running(self) -> bool:
        if self._errors:
            raise RuntimeError(f"driver-side collection failed: {self._errors[0]!r}") from self._errors[0]
        return any(thread.is_alive() for thread in self._threads)

    def stop(self, timeout_s: float = 120.0) -> None:
        """Stop asking for batches; each thread finishes its current one (at most ``timeout_s``)."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout_s)
